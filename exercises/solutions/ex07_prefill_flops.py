"""Exercise 7, the stored solution: perf/flops.py's attended_pairs, copied (the check compares a student's with
perf/flops.py's own, live, and this copy passes it), and prefill_flops."""


def attended_pairs(T, window=None, n_q=None):
    """Number of (query, key) pairs a causal attention over T positions computes, for its last
    n_q queries (default all T), each seeing at most `window` keys (None = all keys <= itself)."""
    n_q = T if n_q is None else n_q
    if window is None:  # query at position t sees t + 1 keys, for t = T - n_q .. T - 1
        return n_q * T - n_q * (n_q - 1) // 2
    assert n_q == T, "windowed attention runs over whole sequences"
    w = min(window, T)  # the first w queries see 1, 2, ..., w keys; every later one sees w
    return w * (w + 1) // 2 + (T - w) * window


def prefill_flops(cfg, T):
    """FLOPs of prefilling one sequence of T tokens (t_out = 1) with the model described by cfg."""
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
