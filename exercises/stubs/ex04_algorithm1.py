"""Exercise 4: Algorithm 1, the Orthros attention layer, with the scale-offsets. Build it from a
layer's parameters.

An OrthrosAttention layer `attn` (orthros.py) holds:
    attn.c_q, attn.c_k, attn.c_v, attn.c_proj   W_Q, W_K, W_V, W_O: nn.Linear (Q, K, V: biases too)
    attn.alpha, attn.beta                       the base tokens' query scale-offset, (C,)
    attn.alpha_out, attn.beta_out               the output tokens' (alpha', beta' of the paper)
    attn.scale_offset                           False in the paper's "w/o SO" ablation: none
    attn.n_head, attn.head_dim, attn.window     H, D = C / H, and w
    attn.n_kv_head                              K, V heads: H, or fewer (grouped-query attention:
                                                query head h reads K, V head h // (H / n_kv_head))
cos, sin are the RoPE tables (T + t_out, D) at the positions of z's rows (an output token sits at
its twin's); orthros.apply_rope(x, cos, sin) rotates x: (B, H, rows, D). You may use apply_rope,
attention_mask, repeat_kv, reference_attention (lines 8-9) and F.scaled_dot_product_attention;
calling the layer (attn(...), a Block, the model) is refused. The checker compares yours with
attn(z, T, (cos, sin)) in float64, float32 and bfloat16, z up to 1e15, and on the meta device (make
every tensor where z is): take every size from attn, z and cos.
"""

import torch
import torch.nn.functional as F

from orthros import apply_rope, attention_mask


def orthros_attention(attn, z, T, cos, sin):
    """Algorithm 1 on attn's parameters (no convolution): z (B, T + t_out, C), T base tokens then
    t_out output tokens; cos, sin (T + t_out, head_dim). Returns (B, T + t_out, C)."""
    raise NotImplementedError
