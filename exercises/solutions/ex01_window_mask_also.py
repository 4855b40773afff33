import torch


def in_window(q_pos, k_pos, window):
    seen = torch.le(k_pos, q_pos)
    if window:
        seen = torch.logical_and(seen, k_pos > q_pos - window)
    return seen


def attention_mask(n_q, n_k, window=None, device=None):
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)
    return mask if window is None else mask.triu(n_k - n_q - window + 1)
