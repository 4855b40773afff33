import math

import torch

from orthros import apply_rope, attention_mask


def orthros_attention(attn, z, T, cos, sin):
    B, L, C = z.shape
    D = cos.size(-1)
    heads = lambda t: t.reshape(B, t.size(1), -1, D).permute(0, 2, 1, 3)
    q, q_out = attn.c_q(z[:, :T]), attn.c_q(z[:, T:])
    if hasattr(attn, 'alpha'):
        q, q_out = attn.alpha * q + attn.beta, attn.alpha_out * q_out + attn.beta_out
    q = torch.cat([apply_rope(heads(q), cos[:T], sin[:T]), apply_rope(heads(q_out), cos[T:], sin[T:])], dim=2)
    k, v = apply_rope(heads(attn.c_k(z[:, :T])), cos[:T], sin[:T]), heads(attn.c_v(z[:, :T]))
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.cat([attention_mask(T, T, attn.window, z.device), attention_mask(L - T, T, None, z.device)])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float('-inf'))
    y = scores.softmax(dim=-1) @ v
    return attn.c_proj(y.permute(0, 2, 1, 3).reshape(B, L, C))
