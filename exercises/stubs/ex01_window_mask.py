"""Exercise 1: the window mask. Replace orthros.in_window and orthros.attention_mask.

Every sliding-window path in orthros.py (the dense reference mask, the blocked path's band mask,
FlexAttention's mask_mod) asks one predicate whether a query may see a key. Write it, and the
(n_q, n_k) mask built from it. The checker compares yours with orthros.py's on many sizes, then
patches both into orthros.py (orthros.in_window = yours) and checks that whole models give the
same logits with swa_impl="dense" and swa_impl="blocked".

The paper's eq. 4: the query at position t sees the keys j with max(1, t-w+1) <= j <= t. Here
positions count from 0.

    python -m exercises start 1       (your own copy: exercises/mine/ex01_window_mask.py)
    python -m exercises check 1       python -m exercises hint 1       python -m exercises show mask
"""

import torch


def in_window(q_pos, k_pos, window):
    """May a query at position q_pos attend a key at k_pos?

    q_pos, k_pos: integer tensors that broadcast against each other, e.g. (n_q, 1) and (1, n_k).
    window: w (an int >= 1), or None for full causal attention (eq. 5), at any distance.
    Returns a bool tensor of the broadcast shape: True where the key is causal (k_pos <= q_pos)
    and, with a window, among the w most recent positions t-w+1 ... t.
    """
    raise NotImplementedError


def attention_mask(n_q, n_k, window=None, device=None):
    """Boolean (n_q, n_k) mask, True where a query may attend a key, built from in_window;
    0 <= n_q <= n_k (n_q = 0: no query, an empty mask).

    The queries are the *last* n_q of the n_k key positions (bottom-right aligned): that is where
    the output tokens and a decoded token sit. device: where to build the mask (None: the default;
    the checker also asks for device="meta", where tensors have shapes but no values).
    """
    raise NotImplementedError
