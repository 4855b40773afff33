"""Exercise 4, the stored solution: Algorithm 1 from an OrthrosAttention's parameters."""

import torch
import torch.nn.functional as F

from orthros import apply_rope, attention_mask, repeat_kv


def orthros_attention(attn, z, T, cos, sin):
    B, L, C = z.shape
    H, D = attn.n_head, attn.head_dim
    t_out = L - T
    x, x_out = z[:, :T], z[:, T:]                                  # line 3: base and output tokens
    k, v = attn.c_k(x), attn.c_v(x)                                # line 4: K, V from base tokens only
    q, q_out = attn.c_q(x), attn.c_q(x_out)                        # line 5: one W_Q, two scale-offsets
    if attn.scale_offset:                                          # (none in the paper's w/o SO ablation)
        q, q_out = attn.alpha * q + attn.beta, attn.alpha_out * q_out + attn.beta_out

    def split(t):                                                  # line 6: (B, rows, heads * D) -> (B, heads, rows, D)
        return t.view(B, t.size(1), -1, D).transpose(1, 2)

    # line 7 (RoPE): every token at its own position; an output token at its twin's
    q = apply_rope(split(q), cos[:T], sin[:T])
    q_out = apply_rope(split(q_out), cos[T:], sin[T:])
    k, v = apply_rope(split(k), cos[:T], sin[:T]), split(v)
    k, v = repeat_kv(k, H), repeat_kv(v, H)                        # GQA: each K, V head serves its group of Q heads
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(T, T, attn.window, z.device))  # line 8
    y_out = F.scaled_dot_product_attention(q_out, k, v, attn_mask=attention_mask(t_out, T, None, z.device))  # line 9
    y = torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C)  # lines 10-11: merge heads, concatenate
    return attn.c_proj(y)                                           # line 12: Y = O W_O
