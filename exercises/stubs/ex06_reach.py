"""Exercise 6: how far each stream can see. Measure it, by perturbing the input.

One sliding-window layer lets position t read positions t-w+1 ... t. Stack L layers and the
information can hop L times, so a sliding-window model's prediction at t depends on the tokens
t - L(w-1) ... t and on nothing before: its reach is L(w-1). Orthros's output stream attends
every earlier key at every layer, so its prediction at t depends on every token 0 ... t.

1. positions_that_change(model, idx, t): the input positions j such that changing token j
   (to any other token, e.g. (idx[0, j] + 1) % vocab_size) changes the logits at position t
   (model(idx)[0][:, t]). Compare exactly: the faint influences are the point. Change a copy:
   idx itself must come back as it was.
2. swa_reach(n_layer, window): how many positions back a sliding-window model's logits at t
   reach (t - reach is the farthest position that still matters).

The checker runs yours on SWA, Orthros and Transformer models of several depths and windows and
compares with the measurement of the stored solution (live, on the same models); your
swa_reach must agree with what it measures.

    python -m exercises start 6       (your own copy: exercises/mine/ex06_reach.py)
    python -m exercises check 6       python -m exercises hint 6
"""

import torch


def positions_that_change(model, idx, t):
    """idx: (1, T) token ids. The sorted list of positions j (0 <= j < T) such that changing
    token j changes model(idx)[0][:, t], the logits at position t."""
    raise NotImplementedError


def swa_reach(n_layer, window):
    """How many positions back the logits at t of an n_layer sliding-window model with this
    window depend on the input: the farthest token that matters is t - swa_reach(n_layer, window)."""
    raise NotImplementedError
