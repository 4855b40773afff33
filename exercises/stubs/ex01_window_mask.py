"""Exercise 1: the window mask. Replace orthros.in_window and orthros.attention_mask.

Every sliding-window path in orthros.py asks one predicate whether a query may see a key. Write
it, and the (n_q, n_k) mask built from it; the checker also patches both into orthros.py and runs
whole models. The paper's eq. 4: the query at t sees the keys j with max(1, t-w+1) <= j <= t
(here positions count from 0); python -m exercises show mask draws it.
"""

import torch


def in_window(q_pos, k_pos, window):
    """May a query at q_pos attend a key at k_pos? Integer tensors that broadcast, e.g. (n_q, 1)
    and (1, n_k); window: w >= 1, or None for full causal attention (eq. 5). A bool tensor: True
    where the key is causal (k_pos <= q_pos) and, with a window, among positions t-w+1 ... t."""
    raise NotImplementedError


def attention_mask(n_q, n_k, window=None, device=None):
    """Boolean (n_q, n_k), 0 <= n_q <= n_k, True where a query may attend a key (in_window). The
    queries are the *last* n_q of the n_k positions (bottom-right aligned), as output tokens and a
    decoded token are. device: where to build it (None: the default; "meta" too)."""
    raise NotImplementedError
