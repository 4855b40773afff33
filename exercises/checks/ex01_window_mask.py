"""Exercise 1, the window mask: the checker. The reference is orthros.py's own in_window and attention_mask."""

from types import SimpleNamespace

import torch

import orthros
from exercises.framework import Domain, patched_logits

TITLE, DIFFICULTY, MINUTES = "The window mask", 1, 20
FUNCTIONS = ("in_window", "attention_mask")
REFERENCE = SimpleNamespace(in_window=orthros.in_window, attention_mask=orthros.attention_mask)
PAPER = "window=128"


def positions(seed, shape, n, far, dtype, **_):
    """q_pos, k_pos of a shape orthros.py and perf/engine.py pass: queries far + 0 ... n-1; keys 0 ... n-1 and far + 0
    ... n-1 (distances up to far + n - 1), or random pairs."""
    g = torch.Generator().manual_seed(seed)
    q, k = far + torch.arange(n), torch.cat([torch.arange(n), far + torch.arange(n)])
    q, k = {"0-d, one pair (FlexAttention's mask_mod)": (q[-1], k[torch.randint(2 * n, (), generator=g)]),
            "1-D pairs of one shape": (q[torch.randint(n, (n,), generator=g)], k[torch.randint(2 * n, (n,), generator=g)]),
            "a column and a row": (q[:, None], k[None, :]), "(1,) and (2n,) (a decoded token)": (q[-1:], k),
            "3-D blocks (2, n, 1) and (2, 1, 2n)": (torch.stack([q, q + n])[:, :, None], torch.stack([k, k + n])[:, None])}[shape]
    return dict(q_pos=q.to(dtype), k_pos=k.to(dtype))


windows = lambda n, far=0: [None, *sorted({w for w in (1, 2, n - 1, n, n + 1, far, far + 1, 128) if w >= 1})]
DOMAIN = {
    "in_window": Domain(positions, pairs=[("far", "window"), ("shape", "window")], draws=20,
                        shape=["0-d, one pair (FlexAttention's mask_mod)", "1-D pairs of one shape", "a column and a row",
                               "(1,) and (2n,) (a decoded token)", "3-D blocks (2, n, 1) and (2, 1, 2n)"],
                        n=[1, 2, 3, 5, 8], far=[0, 127, 300, 2 ** 15 + 1, 2 ** 16 + 3, 2 ** 40],
                        dtype=lambda far: [torch.int64] + [torch.int32] * (far < 2 ** 31), window=windows),
    "attention_mask": Domain(pairs=[("n_k", "n_q"), ("n_k", "window"), ("n_q", "window"), ("device", "default")], draws=20,
                             n_k=[0, 1, 2, 3, 5, 8, 300, 4096, 70000],
                             n_q=lambda n_k: sorted({q for q in (0, 1, 2, n_k - 1, n_k) if 0 <= q <= min(n_k, 300)}),
                             window=lambda n_k: windows(n_k, 40000), device=[None, "cpu", "meta"], default=["cpu", "meta"])}


def whole_models(answer, **options):
    """whole models with yours patched into orthros.py"""
    return patched_logits([("orthros", "dense", 21, 4, 5), ("swa", "blocked", 21, 4, 21),
                                   ("orthros", "blocked", 300, 128, 37)],
                          in_window=answer.in_window, attention_mask=answer.attention_mask)


PROPERTIES = [whole_models]
