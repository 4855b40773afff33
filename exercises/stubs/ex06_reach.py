"""Exercise 6: how far each stream can see. Measure it, by perturbing the input.

One sliding-window layer lets position t read positions t-w+1 ... t; through L layers, a
sliding-window model's prediction at t depends on tokens t - L(w-1) ... t alone: its reach is
L(w-1). Orthros's output stream attends every earlier key at every layer: every token 0 ... t.

1. positions_that_change(model, idx, t): the positions j such that changing token j (to any other,
   e.g. (idx[0, j] + 1) % vocab_size) changes the logits at t, model(idx)[0][:, t]. Compare
   exactly: the faint influences are the point. Change a copy: idx must come back as it was.
2. swa_reach(n_layer, window): how many positions back a sliding-window model's logits reach.
The checker compares both with what it measures on SWA, Orthros and Transformer models.
"""

import torch


def positions_that_change(model, idx, t):
    """idx: (1, T) token ids. The sorted list of positions j (0 <= j < T) such that changing
    token j changes model(idx)[0][:, t], the logits at position t."""
    raise NotImplementedError


def swa_reach(n_layer, window):
    """The farthest token the logits at t of a sliding-window model depend on: t - swa_reach."""
    raise NotImplementedError
