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
