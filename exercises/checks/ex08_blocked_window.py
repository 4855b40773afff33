"""Exercise 8, the sliding window in O(T w): the checker. The reference is orthros.py's own blocked attention."""

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import orthros
from exercises.framework import Domain, patched_logits, randn

TITLE, DIFFICULTY, MINUTES = "The sliding window in O(T w)", 4, 50
FUNCTIONS = ("blocked_sliding_window_attention",)
REFERENCE = SimpleNamespace(blocked_sliding_window_attention=orthros.blocked_sliding_window_attention)
FORBIDDEN = dict.fromkeys((orthros.reference_attention, orthros.fast_reference_attention, orthros.flex_sliding_window_attention,
                           orthros.sliding_window_block_mask, orthros.cached_sliding_window_block_mask),
                          "it computes the windowed attention this exercise asks you to write")
PAPER = "window=128"

HINTS = [
    "Query t sees keys t-w+1 ... t. Put the queries in blocks of w: block b holds positions b*w ... b*w + w-1, and "
    "every key they may see lies in block b-1 or block b. So give each block its 2w keys (the previous block and its "
    "own), and mask with in_window inside that small (w, 2w) window. Pad T up to whole blocks, and give the keys one "
    "extra block of padding in front for block 0 (masked out).",
    "Shapes (n = ceil(T / w) blocks; pad T up to n*w):\n"
    "queries: (B, H, T, D) -> padded at the end -> (B*H, n, w, D)\n"
    "keys, values: padded with one block of w in front and the same padding at the end -> (B*H, n+1, w, D); then block"
    " b's keys are blocks b and b+1 of that, side by side: (B*H, n, 2w, D)\n"
    "positions: query i of block b sits at b*w + i, a (n, w, 1) grid; key j of its 2w keys at (b-1)*w + j, a (n, 1, "
    "2w) grid; the mask is in_window of the two, and the front padding (negative positions) hidden\n"
    "one scaled_dot_product_attention over the blocks with that (n, w, 2w) mask (and dropout_p), then back to (B, H, "
    "n*w, D) and the first T rows",
    "Paper, Algorithm 1, line 8: O <- Flash-Attn(Q, K, V, window_size=W), and section 3.3: sliding window attention "
    "costs O(T W d), linear in T. In orthros.py: part 3 (fast paths), blocked_sliding_window_attention.",
]


SHAPES = "    B, H, T, D = q.shape\n"


def inputs(seed, T, shape, views, scale, **_):
    """q, k, v: (B, H, T, D), q and k times scale; views: transposed views of (B, T, H, D) tensors, as the model's."""
    B, H, D = shape
    made = [randn(B, T, H, D, seed=seed + i).transpose(1, 2) if views else randn(B, H, T, D, seed=seed + i) for i in range(3)]
    return dict(q=made[0] * scale, k=made[1] * scale, v=made[2])


DOMAIN = {"blocked_sliding_window_attention": Domain(
    inputs, pairs=[("T", "window"), ("views", "window"), ("dtype", "scale"), ("dropout_p", "T"), ("place", "shape")],
    draws=10, T=[0, 1, 2, 3, 5, 8, 9, 21, 64, 300], window=lambda T: sorted({w for w in (1, 2, T - 1, T, T + 1, 128, 200) if w >= 1}),
    shape=[(2, 3, 4), (1, 1, 6), (3, 2, 8), (2, 6, 128)], views=[False, True], dropout_p=[0.0, 0.5],
    dtype=[torch.float64, torch.float32, torch.bfloat16], place=["cpu"] * 3 + ["meta"],
    scale=lambda dtype: [1.0, 1e3, 1e15] if dtype != torch.bfloat16 else [1.0])}


def whole_models(answer, **options):
    """whole models with yours patched into orthros.py"""
    return patched_logits([("swa", "blocked", 27, 4, 27), ("orthros", "blocked", 27, 4, 5)],
                          blocked_sliding_window_attention=answer.blocked_sliding_window_attention)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any tensor made by an operation holds (its storage: a view costs what it views)."""
    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size() if isinstance(t, torch.Tensor) else 0)
        return out


def memory(answer, **options):
    """O(T w) memory: no tensor made holds more than 8 T w elements (the dense mask: T^2 = 32 T w), at T=4096, w=128"""
    T, w = 4096, 128
    with torch.no_grad(), LargestTensor() as mode:
        answer.blocked_sliding_window_attention(*(randn(1, 1, T, 4, seed=i) for i in range(3)), w)
    if mode.largest > 8 * T * w:
        return f"your largest tensor holds {mode.largest:,} elements = {mode.largest / (T * w):.0f} T w"


PROPERTIES = [whole_models, memory]
