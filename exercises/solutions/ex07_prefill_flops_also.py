def attended_pairs(T, window=None, n_q=None):
    n_q = T if n_q is None else n_q
    return sum(t + 1 if window is None else min(t + 1, window) for t in range(T - n_q, T))


def prefill_flops(cfg, T):
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    outputs = 1 if cfg.attn == 'orthros' else 0
    matrices = 2 * C * C * (T + outputs) * 2 + 2 * C * C * T * 2 + 2 * 8 * C * C * (T + outputs)
    pairs = attended_pairs(T, None if cfg.attn == 'transformer' else cfg.window)
    pairs += attended_pairs(T, None, 1) * outputs
    return L * (matrices + 2 * 2 * C * pairs) + 2 * C * V
