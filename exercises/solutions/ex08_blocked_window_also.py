import math

import torch
import torch.nn.functional as F


def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):
    B, H, T, D = q.shape
    w, n = window, -(-T // window)
    rows = n * w
    q = torch.cat([q, q.new_zeros(B, H, rows - T, D)], dim=2).reshape(B * H, n, w, D)
    pad = lambda x: torch.cat([x.new_zeros(B, H, w, D), x, x.new_zeros(B, H, rows - T, D)], dim=2)
    k, v = (pad(x).reshape(B * H, n + 1, w, D) for x in (k, v))
    k, v = (torch.cat([x[:, :n], x[:, 1:]], dim=2) for x in (k, v))
    i = torch.arange(w, device=q.device)[:, None]
    j = torch.arange(2 * w, device=q.device)[None, :]
    first = torch.arange(n, device=q.device)[:, None, None] * w
    seen = (j <= i + w) & (j > i) & (first - w + j >= 0)           # key j of 2w: position b*w - w + j
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float('-inf'))
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + bias, dim=-1)
    y = F.dropout(weights, dropout_p) @ v
    return y.reshape(B, H, rows, D)[:, :, :T]
