"""Exercise 7, the stored solution: perf/flops.py's own attended_pairs (`solution 7 --show` writes it out), and
prefill_flops."""

from perf.flops import attended_pairs


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
