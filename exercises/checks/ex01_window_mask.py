"""Exercise 1, the window mask: the checker. The reference: orthros.py's own functions."""

from types import SimpleNamespace

import torch

import orthros
from exercises.framework import Domain, whole_models, within

TITLE, DIFFICULTY, MINUTES = "The window mask", 1, 20
FUNCTIONS = ("in_window", "attention_mask")
REFERENCE = SimpleNamespace(in_window=orthros.in_window, attention_mask=orthros.attention_mask)
PAPER = "window=128"
SHAPES = ["0-d, one pair (FlexAttention's mask_mod)", "1-D pairs of one shape", "column and row",
          "(1,) and (2n,): a decoded token", "3-D blocks (2, n, 1), (2, 1, 2n): the blocked path"]


def positions(seed, shape, n, far, dtype, **_):
    """q_pos, k_pos as orthros.py passes them: queries at far + 0 ... n-1, keys 0 ... far + n-1."""
    g = torch.Generator().manual_seed(seed)
    q, k = far + torch.arange(n), torch.cat([torch.arange(n), far + torch.arange(n)])
    pick = lambda x, *shape: x[torch.randint(len(x), shape, generator=g)]
    q = [(pick(q), pick(k)), (pick(q, n), pick(k, n)), (q[:, None], k[None]), (q[-1:], k),
            (torch.stack([q, q + n])[:, :, None], torch.stack([k, k + n])[:, None])]
    q, k = q[SHAPES.index(shape)]
    return dict(q_pos=q.to(dtype), k_pos=k.to(dtype))


windows = lambda n, far=0: [None, *within(1, 2 ** 41, 1, 2, n - 1, n, n + 1, far, far + 1, 128)]
DOMAIN = {"in_window": Domain(
    positions, pairs=[("far", "window"), ("shape", "window")], draws=5, shape=SHAPES,
    n=[1, 2, 3, 5, 8], far=[0, 127, 300, 2 ** 15 + 1, 2 ** 16 + 3, 2 ** 40],
    dtype=lambda far: [torch.int64] + [torch.int32] * (far < 2 ** 31), window=windows),
    "attention_mask": Domain(
    pairs=[("n_k", "n_q"), ("n_k", "window"), ("n_q", "window"), ("device", "default")], draws=5,
    n_k=[0, 1, 2, 3, 5, 8, 300, 4096, 70000], window=lambda n_k: windows(n_k, 40000),
    n_q=lambda n_k: within(0, min(n_k, 300), 0, 1, 2, n_k - 1, n_k), device=[None, "cpu", "meta"],
    default=["cpu", "meta"])}
PROPERTIES = [whole_models(("orthros", "dense", 21, 4, 5), ("swa", "blocked", 21, 4, 21),
                           ("orthros", "blocked", 300, 128, 37))]
