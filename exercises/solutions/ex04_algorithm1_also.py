"""Exercise 4: another right answer, written otherwise than the stored solution (the check passes it too)."""

import math

import torch

from orthros import apply_rope, attention_mask


def orthros_attention(attn, z, T, cos, sin):
    B, L, C = z.shape
    D = cos.size(-1)
    H = C // D
    heads = lambda t: t.reshape(B, t.size(1), H, D).permute(0, 2, 1, 3)
    q = apply_rope(heads(attn.alpha * attn.c_q(z[:, :T]) + attn.beta), cos[:T], sin[:T])
    q_out = apply_rope(heads(attn.alpha_out * attn.c_q(z[:, T:]) + attn.beta_out), cos[T:], sin[T:])
    k, v = apply_rope(heads(attn.c_k(z[:, :T])), cos[:T], sin[:T]), heads(attn.c_v(z[:, :T]))
    q = torch.cat([q, q_out], dim=2)
    mask = torch.cat([attention_mask(T, T, attn.window, z.device), attention_mask(L - T, T, None, z.device)])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float('-inf'))
    y = scores.softmax(dim=-1) @ v
    return attn.c_proj(y.permute(0, 2, 1, 3).reshape(B, L, C))
