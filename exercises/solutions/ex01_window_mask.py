"""Exercise 1, the stored solution: orthros.py's in_window and attention_mask, copied."""

import torch


def in_window(q_pos, k_pos, window):
    causal = k_pos <= q_pos
    return causal if window is None else causal & (q_pos - k_pos < window)


def attention_mask(n_q, n_k, window=None, device=None):
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]   # (n_q, 1)
    k_pos = torch.arange(n_k, device=device)[None, :]              # (1, n_k)
    return in_window(q_pos, k_pos, window)
