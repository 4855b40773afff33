"""Exercise 1, the stored solution: orthros.py's in_window and attention_mask, copied (the check compares a student's
with orthros.py's own, live, and this copy passes it)."""

import torch


def in_window(q_pos, k_pos, window):
    """May a query at position q_pos attend a key at k_pos? Causal, and with a window w also
    q_pos - k_pos < w: query t sees keys t-w+1 ... t (eq. 4); window=None: all keys <= t (eq. 5)."""
    causal = k_pos <= q_pos
    return causal if window is None else causal & (q_pos - k_pos < window)


def attention_mask(n_q, n_k, window=None, device=None):
    """Boolean (n_q, n_k), True where a query may attend a key. The queries are the *last* n_q
    of the n_k positions, as output tokens and decoded tokens are."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]   # (n_q, 1)
    k_pos = torch.arange(n_k, device=device)[None, :]              # (1, n_k)
    return in_window(q_pos, k_pos, window)
