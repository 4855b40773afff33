"""Exercise 4, Algorithm 1 with the scale-offsets: the checker. The reference: the layer's own."""

import copy
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, made, randn, within
from orthros import Block, Orthros, OrthrosAttention, rope_cos_sin

TITLE, DIFFICULTY, MINUTES = "Algorithm 1 with the scale-offsets", 3, 45
FUNCTIONS = ("orthros_attention",)
REFERENCE = SimpleNamespace(orthros_attention=lambda attn, z, T, cos, sin: attn(z, T, (cos, sin)))
FORBIDDEN = dict.fromkeys((OrthrosAttention.forward, Block.forward, Orthros.forward), "it runs "
                          "the layer (Algorithm 1) this exercise asks you to write")
PAPER = "w=128"
BF16 = torch.bfloat16
# The last layer of each zoo member but the convolution's, at w=3; at w=5; the bench model's
LAYERS = {**{f"{name}, w=3": (name, dict(window=3)) for name in ZOO if "conv" not in name},
          "the original, w=5": ("the original", dict(window=5)),
          "n_head=6, C=768 (the bench model's attention), w=128": (
              "the original", dict(n_layer=1, n_head=6, n_embd=768, window=128, mlp_hidden=8))}


def inputs(seed, layer, B, T, t_out, rope_base, scale, **_):
    name, more = LAYERS[layer]
    attn = copy.deepcopy(made(name, "orthros", seed, **more).blocks[-1].attn)   # the layer alone
    at = torch.cat([torch.arange(T), torch.arange(T - t_out, T)])   # an output token at its twin's
    cos, sin = rope_cos_sin(at, attn.head_dim, rope_base, torch.float64)
    return dict(attn=attn, z=scale * randn(B, T + t_out, attn.n_head * attn.head_dim, seed=seed),
                cos=cos, sin=sin)


DOMAIN = {"orthros_attention": Domain(
    inputs, pairs=[("T", "t_out"), ("dtype", "scale")], draws=5,
    layer=list(LAYERS), B=[1, 2], T=[1, 2, 3, 5, 8, 13, 300], rope_base=[10000.0, 500.0],
    t_out=lambda T: within(1, T, 1, 2, T - 1, T), dtype=[torch.float64, torch.float32, BF16],
    place=["cpu"] * 3 + ["meta"], scale=lambda dtype: [1.0, 1e3, 1e15][:1 + 2 * (dtype != BF16)])}
