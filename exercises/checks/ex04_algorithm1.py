"""Exercise 4, Algorithm 1 with the scale-offsets: the checker. The reference is the layer's own forward."""

import copy
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, randn
from orthros import Block, Orthros, OrthrosAttention, rope_cos_sin

TITLE, DIFFICULTY, MINUTES = "Algorithm 1 with the scale-offsets", 3, 45
FUNCTIONS = ("orthros_attention",)
REFERENCE = SimpleNamespace(orthros_attention=lambda attn, z, T, cos, sin: attn(z, T, (cos, sin)))
FORBIDDEN = dict.fromkeys((OrthrosAttention.forward, Block.forward, Orthros.forward),
                          "it runs the layer (Algorithm 1) that this exercise asks you to write from its parameters")
PAPER = "w=128"

HINTS = [
    "Split z into the base tokens x (the first T rows) and the output tokens x' (the other t_out). Keys and values "
    "come from x only: they are the KV cache. Both streams use the same W_Q; only their element-wise scale-offsets "
    "differ. Base queries attend with the window, output queries attend every key up to their own position. Then merge"
    " heads, concatenate, and apply W_O once.",
    "Shapes (H heads of D = C / H channels; t_out = z.size(1) - T):\n"
    "K, V: W_K, W_V on the base rows only -> (B, T, C) each\n"
    "Q: W_Q on the base rows, then alpha (.) q + beta; Q': W_Q on the output rows, then alpha' (.) q' + beta'\n"
    "split heads: (B, rows, C) -> (B, H, rows, D)\n"
    "RoPE on Q and K with the first T rows of cos, sin; on Q' with the last t_out rows; not on V\n"
    "base attention: Q (B, H, T, D) against K, V with the window's (T, T) mask; output attention: Q' (B, H, t_out, D) "
    "against the same K, V with the causal (t_out, T) mask, bottom-right aligned\n"
    "stack the two results along the rows, merge heads back to (B, T + t_out, C), then W_O",
    "Paper, Algorithm 1: line 3 splits X and X_cross; line 4, K, V <- XW_K, XW_V (the shared KV cache); line 5, Q, "
    "Q_cross <- alpha (.) (XW_Q) + beta, alpha' (.) (X_cross W_Q) + beta'; lines 8-9, Flash-Attn with window_size=W, "
    "then window_size=inf; lines 10-12, merge heads, concatenate, Y = OW_O. In orthros.py: OrthrosAttention.forward, "
    "marks '# Alg. 1, line N'.",
]

BASE_MASK, OUT_MASK = "attention_mask(T, T, attn.window, z.device)", "attention_mask(t_out, T, None, z.device)"
SDPA, SDPA_OUT = "F.scaled_dot_product_attention(q, k, v, attn_mask=", "F.scaled_dot_product_attention(q_out, k, v, attn_mask="

# The layers: the last OrthrosAttention of each of the zoo's models but the convolution's, at w=3; w=5; the bench's
LAYERS = {**{f"{name}, w=3": (name, dict(window=3)) for name in ZOO if "conv" not in name},
          "the original, w=5": ("the original", dict(window=5)),
          "n_head=6, C=768 (the bench model's attention), w=128": ("the original", dict(n_layer=1, n_head=6, n_embd=768,
                                                                                        window=128, mlp_hidden=8))}


def inputs(seed, layer, B, T, t_out, rope_base, scale, **_):
    name, more = LAYERS[layer]
    attn = copy.deepcopy(member(name, seed=seed, **more).blocks[-1].attn)
    cos, sin = rope_cos_sin(torch.cat([torch.arange(T), torch.arange(T - t_out, T)]), attn.head_dim, rope_base, torch.float64)
    return dict(attn=attn, z=scale * randn(B, T + t_out, attn.n_head * attn.head_dim, seed=seed), cos=cos, sin=sin)


DOMAIN = {"orthros_attention": Domain(inputs, pairs=[("layer", "dtype"), ("T", "t_out"), ("dtype", "scale"), ("layer", "T")],
                                      layer=list(LAYERS), B=[1, 2], T=[1, 2, 3, 5, 8, 13, 300],
                                      t_out=lambda T: sorted({1, 2, T - 1, T} - {0, T + 1}), rope_base=[10000.0, 500.0],
                                      dtype=[torch.float64, torch.float32, torch.bfloat16], place=["cpu"] * 3 + ["meta"],
                                      scale=lambda dtype: [1.0, 1e3, 1e15] if dtype != torch.bfloat16 else [1.0])}
