"""Exercise 7, the stored solution: perf/flops.py's attended_pairs, copied, and prefill_flops."""


def attended_pairs(T, window=None, n_q=None):
    n_q = T if n_q is None else n_q
    if window is None:  # query at position t sees t + 1 keys, for t = T - n_q .. T - 1
        return n_q * T - n_q * (n_q - 1) // 2
    assert n_q == T, "windowed attention runs over whole sequences"
    w = min(window, T)  # the first w queries see 1, 2, ..., w keys; every later one sees w
    return w * (w + 1) // 2 + (T - w) * window


def prefill_flops(cfg, T):
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    n_tokens = T + 1 if cfg.attn == "orthros" else T          # Orthros: one output token
    tokenwise = 2 * (10 * C * C * n_tokens + 2 * C * C * T)   # W_Q, W_O, MLP on every token; W_K, W_V on base tokens
    if cfg.attn == "transformer":
        pairs = attended_pairs(T)                               # full causal: T(T+1)/2
    else:
        pairs = attended_pairs(T, cfg.window)                   # the window: at most w keys per query
        if cfg.attn == "orthros":
            pairs += attended_pairs(T, None, n_q=1)             # the output token attends all T keys
    return L * (tokenwise + 4 * C * pairs) + 2 * C * V          # the LM head at the last position only
