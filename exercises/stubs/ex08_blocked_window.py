"""Exercise 8: the sliding window in O(T w). Replace orthros.blocked_sliding_window_attention.

The readable reference, orthros.reference_attention, builds a (T, T) mask: T^2 entries, of
which only about T w are True. At T = 128K that mask alone is 16 G entries. Write the window in
O(T w) time and memory: cut the sequence into blocks of w queries; every key a query of block b
may see lies in block b-1 or block b, so each block attends its 2w keys through a small
(w, 2w) band mask built from orthros.in_window.

The checker compares yours with orthros.py's, forward and backward, for T from 0 to 300 and every
window from 1 to past T, in float64, float32 and bfloat16 (keep q's dtype, every step in it), on
inputs that are views (as the model's q, k, v are), on q and k up to 1e15 (a softmax subtracts each
row's max), with dropout (after the same torch.manual_seed: one scaled_dot_product_attention over
all the blocks draws orthros.py's mask), and on the meta device (make every tensor on q.device);
patches it into orthros.py and checks that whole models give the same logits, and records every
tensor your function creates at T = 4096, w = 128: none may hold more than 8 T w elements (the
dense (T, T) mask holds T^2 = 32 T w). orthros.py's windowed attentions (reference_attention,
fast_reference_attention, the FlexAttention path) are refused while your code runs.

    python -m exercises start 8       (your own copy: exercises/mine/ex08_blocked_window.py)
    python -m exercises check 8       python -m exercises hint 8
"""

import math

import torch
import torch.nn.functional as F

from orthros import in_window


def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):
    """Eq. 4 in O(T w): the same result as orthros.reference_attention(q, k, v, window)
    without the (T, T) mask. q, k, v: (B, H, T, D), the queries at the same T positions as the
    keys. dropout_p: attention dropout, passed on to scaled_dot_product_attention."""
    raise NotImplementedError
