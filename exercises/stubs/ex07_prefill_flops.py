"""Exercise 7: prefill FLOPs. Replace perf/flops.py's attended_pairs, and count prefill's FLOPs.

Prefill runs the prompt (T tokens) once and predicts one token: t_out = 1. The Transformer pays
full causal attention over T positions; SWA and Orthros's base tokens see at most w keys each;
Orthros adds one output token, whose query attends all T keys. Count them as perf/flops.py does,
every term in FLOPs (a multiply-add is 2 FLOPs: a C x C matrix costs one token 2 C^2 FLOPs):

  per layer:
    token-wise, on every token that flows through the layer: W_Q and W_O, 2 C^2 FLOPs each, and
      the MLP's two matrices (C x 4C and 4C x C), 8 C^2 FLOPs each: 20 C^2 FLOPs a token;
      on the T base tokens only: W_K and W_V, 2 C^2 FLOPs each: 4 C^2 FLOPs a token;
    attention: Q K^T and P V, 2 C FLOPs each per (query, key) pair: 4 C FLOPs a pair;
  plus the LM head (C x V): 2 C V FLOPs for each position that gets logits (prefill: 1).
  Norms, RoPE, softmax, GELU and the embedding lookup are left out.

The checker compares both functions with perf/flops.py (attended_pairs, forward_flops(cfg, T, 1),
refused while yours run), patches your attended_pairs in, and prints the FLOP-limit speedup of
Orthros over the Transformer next to a measured CPU prefill speedup.
"""


def attended_pairs(T, window=None, n_q=None):
    """The (query, key) pairs a causal attention over T >= 0 positions computes for its last n_q
    queries (0 <= n_q <= T, default T; with a window, T), each seeing at most `window` keys (None:
    every key up to itself)."""
    raise NotImplementedError


def prefill_flops(cfg, T):
    """FLOPs of prefilling T tokens (t_out = 1) with the model cfg (an orthros.OrthrosConfig)."""
    raise NotImplementedError
