"""Exercise 8, the sliding window in O(T w): the checker. The reference: orthros.py's own."""

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import orthros
from exercises import framework
from exercises.framework import Domain, randn, whole_models, within

TITLE, DIFFICULTY, MINUTES = "The sliding window in O(T w)", 4, 50
FUNCTIONS = ("blocked_sliding_window_attention",)
REFERENCE = SimpleNamespace(
    blocked_sliding_window_attention=orthros.blocked_sliding_window_attention)
FORBIDDEN = dict.fromkeys((orthros.reference_attention, orthros.fast_reference_attention,
                           orthros.flex_sliding_window_attention, orthros.sliding_window_block_mask,
                           orthros.cached_sliding_window_block_mask), "it computes what you write")
PAPER, SHAPES, BF16 = "window=128", [(2, 3, 4), (1, 1, 6), (3, 2, 8)], torch.bfloat16   # (B, H, D)


def inputs(seed, T, shape, views, scale, **_):
    """q, k, v (B, H, T, D), q and k times scale; views: transposed, as the model passes them."""
    (B, H, D), seeds = shape, range(seed, seed + 3)
    made = [randn(B, T, H, D, seed=s).transpose(1, 2) if views else randn(B, H, T, D, seed=s)
            for s in seeds]
    return dict(q=made[0] * scale, k=made[1] * scale, v=made[2])


DOMAIN = {"blocked_sliding_window_attention": Domain(
    inputs, pairs=[("T", "window"), ("dtype", "scale"), ("views", "window")], draws=5,
    T=[0, 1, 2, 3, 5, 8, 9, 21, 64, 300], place=["cpu"] * 3 + ["meta"],
    window=lambda T: within(1, 300, 1, 2, T - 1, T, T + 1, 128, 200), views=[False, True],
    dropout_p=[0.0, 0.5], dtype=[torch.float64, torch.float32, BF16],
    scale=lambda dtype: [1.0, 1e3, 1e15][:1 + 2 * (dtype != BF16)],
    shape=lambda T, place, dtype: SHAPES + [(2, 6, 128)] * (   # the paper's D: meta, or small
        place == "meta" or T < 64 and dtype != BF16))}


class LargestTensor(TorchDispatchMode):
    """Records the most elements a tensor made by an operation holds (a view: what it views)."""
    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in framework.tensors(out if isinstance(out, (tuple, list)) else [out]):
            self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def memory(answer, **options):
    """O(T w) memory: at T=4096, w=128 no tensor made holds over 8 T w elements (T^2 = 32 T w)"""
    T, w = 4096, 128
    with torch.no_grad(), LargestTensor() as mode:
        answer.blocked_sliding_window_attention(*(randn(1, 1, T, 4, seed=i) for i in range(3)), w)
    if mode.largest > 8 * T * w:
        return f"your largest tensor holds {mode.largest / (T * w):.0f} T w elements"


PROPERTIES = [whole_models(("swa", "blocked", 27, 4, 27), ("orthros", "blocked", 27, 4, 5)), memory]
