"""Exercise 8, the sliding window in O(T w): the checker, hints and known bugs. The solution is
orthros.py's own blocked_sliding_window_attention."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import orthros
from exercises.framework import Bug, Case, Mutant, patched, randn, tiny_model, tokens

TITLE = "The sliding window in O(T w)"
DIFFICULTY = 4
MINUTES = 50
TEACHES = "the blocked window: blocks of w queries over 2w keys, equal to the dense reference forward and backward, with O(T w) memory"
FUNCTIONS = ("blocked_sliding_window_attention",)
REFERENCE = SimpleNamespace(blocked_sliding_window_attention=orthros.blocked_sliding_window_attention)
RETURNS = {"blocked_sliding_window_attention": "output"}
WINDOWED = "it computes the windowed attention this exercise asks you to write"
FORBIDDEN = {orthros.reference_attention: WINDOWED, orthros.fast_reference_attention: WINDOWED,
             orthros.flex_sliding_window_attention: WINDOWED, orthros.sliding_window_block_mask: WINDOWED,
             orthros.cached_sliding_window_block_mask: WINDOWED}

HINTS = [
    "Query t sees keys t-w+1 ... t. Put the queries in blocks of w: block b holds positions b*w ... "
    "b*w + w-1, and every key they may see lies in block b-1 or block b. So give each block its 2w keys "
    "(the previous block and its own), and mask with in_window inside that small (w, 2w) window. Pad T "
    "up to whole blocks, and give the keys one extra block of padding in front for block 0 (masked out).",
    "Shapes (n = ceil(T / w) blocks; pad T up to n*w):\n"
    "queries: (B, H, T, D) -> padded at the end -> (B*H, n, w, D)\n"
    "keys, values: padded with one block of w in front and the same padding at the end -> (B*H, n+1, w, D); "
    "then block b's keys are blocks b and b+1 of that, side by side: (B*H, n, 2w, D)\n"
    "positions: query i of block b sits at b*w + i, a (n, w, 1) grid; key j of its 2w keys at (b-1)*w + j, "
    "a (n, 1, 2w) grid; the mask is in_window of the two, and the front padding (negative positions) hidden\n"
    "one scaled_dot_product_attention over the blocks with that (n, w, 2w) mask (and dropout_p), then back "
    "to (B, H, n*w, D) and the first T rows",
    "Paper, Algorithm 1, line 8: O <- Flash-Attn(Q, K, V, window_size=W), and section 3.3: sliding window "
    "attention costs O(T W d), linear in T. In orthros.py: part 3 (fast paths), blocked_sliding_window_attention.",
]


# -- Known bugs: orthros.py's function with one classic mistake --------------------------------

def make_bug(own_block_only=False, no_front_mask=False):
    def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):
        B, H, T, D = q.shape
        w = window
        n_blocks = math.ceil(T / w)
        pad = n_blocks * w - T
        q = F.pad(q, (0, 0, 0, pad)).reshape(B * H, n_blocks, w, D)
        k = F.pad(k, (0, 0, w, pad)).reshape(B * H, n_blocks + 1, w, D)
        v = F.pad(v, (0, 0, w, pad)).reshape(B * H, n_blocks + 1, w, D)
        k, v = torch.cat([k[:, :-1], k[:, 1:]], dim=2), torch.cat([v[:, :-1], v[:, 1:]], dim=2)
        blk = torch.arange(n_blocks)[:, None, None]
        q_pos = blk * w + torch.arange(w)[None, :, None]
        k_pos = (blk - 1) * w + torch.arange(2 * w)[None, None, :]
        mask = orthros.in_window(q_pos, k_pos, w)
        if own_block_only:  # the previous block is never seen
            mask = mask & (k_pos >= blk * w)
        elif not no_front_mask:  # no_front_mask: the padding block in front is attended
            mask = mask & (k_pos >= 0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y.reshape(B, H, n_blocks * w, D)[:, :, :T]
    return SimpleNamespace(blocked_sliding_window_attention=blocked_sliding_window_attention)


def dense_in_disguise(q, k, v, window, dropout_p=0.0):
    mask = orthros.attention_mask(q.size(-2), k.size(-2), window)   # (T, T): right numbers, O(T^2) memory
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


BUGS = [
    Bug("the padding block in front not masked", "without k_pos >= 0, the queries of block 0 also attend "
        "the w zero keys of the padding (score 0, value 0): their softmax is diluted.", make_bug(no_front_mask=True)),
    Bug("each block attends its own keys only", "a query early in its block needs keys of the previous block "
        "too: query t sees t-w+1 ... t, which crosses the block boundary unless t is the block's last.",
        make_bug(own_block_only=True)),
    Bug("the dense (T, T) mask", "the numbers are right, but the mask alone holds T^2 entries: O(T^2) memory, "
        "the cost the blocked path exists to avoid.",
        SimpleNamespace(blocked_sliding_window_attention=dense_in_disguise)),
]


# -- Cases --------------------------------------------------------------------------------------

SIZES = [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (3, 8), (8, 4), (9, 4), (21, 8), (32, 8), (64, 64), (100, 7)]
EQ4 = "equal to orthros.reference_attention: query t attends exactly keys t-w+1 ... t (eq. 4)"


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

def scaled_in_place(q, k, v, window, dropout_p=0.0):
    q.mul_(2.0)                                    # changes the caller's q ...
    return REFERENCE.blocked_sliding_window_attention(q / 2.0, k, v, window, dropout_p)   # ... right numbers


MUTANTS = [
    Mutant("the dense reference called", SimpleNamespace(blocked_sliding_window_attention=
                                                         lambda q, k, v, window, dropout_p=0.0:
                                                         orthros.reference_attention(q, k, v, window, dropout_p)),
           expect="your code called orthros.reference_attention"),
    Mutant("q changed in place", SimpleNamespace(blocked_sliding_window_attention=scaled_in_place),
           expect="changed its input `q` in place"),
]


def cases(**options):
    found = []
    for T, w in SIZES:
        found.append(Case(
            f"blocked_sliding_window_attention(q, k, v, window={w}), q, k, v of shape (2, 3, {T}, 4)",
            inputs=lambda T=T, w=w: dict(zip("qkv", (randn(2, 3, T, 4, seed=T * 100 + w + i) for i in range(3))), window=w),
            call=lambda answer, q, k, v, window: answer.blocked_sliding_window_attention(q, k, v, window),
            invariant=EQ4 + ", forward", atol=1e-12,
            expected=lambda q, k, v, window: orthros.reference_attention(q, k, v, window)))
    for T, w in SIZES[2::2]:
        found.append(Case(
            f"the gradients of (blocked_sliding_window_attention(q, k, v, window={w}) * dy).sum() with respect to "
            f"q, k, v, all of shape (2, 3, {T}, 4)",
            inputs=lambda T=T, w=w: dict(zip(("q", "k", "v", "dy"), (randn(2, 3, T, 4, seed=T * 100 + w + i)
                                                                     for i in range(4))), window=w),
            call=lambda answer, q, k, v, dy, window: grads(answer.blocked_sliding_window_attention, q, k, v, dy, window),
            invariant=EQ4 + ", backward: the same gradients", atol=1e-12,
            expected=lambda q, k, v, dy, window: grads(orthros.reference_attention, q, k, v, dy, window),
            output="your gradients"))
    for attn in ("swa", "orthros"):
        model = tiny_model(attn, window=4, swa_impl="blocked")
        found.append(Case(
            f"whole-model logits, attn={attn!r}, swa_impl='blocked', T=27, w=4, with yours patched into orthros.py",
            inputs=lambda model=model: dict(model=model, idx=tokens(2, 27)),
            call=patched_logits,
            invariant="the model's logits are unchanged with your function as its sliding window", atol=1e-12,
            output="the model's logits"))
    T, w = 4096, 128
    found.append(Case(
        f"the largest tensor created during blocked_sliding_window_attention(q, k, v, window={w}), q, k, v of "
        f"shape (1, 1, {T}, 4)",
        inputs=lambda: dict(zip("qkv", (randn(1, 1, T, 4, seed=i) for i in range(3))), window=w),
        call=lambda answer, q, k, v, window: largest_tensor(answer.blocked_sliding_window_attention, q, k, v, window),
        invariant="O(T w) memory: no intermediate tensor holds more than 8 T w elements (the dense mask: T^2 = 32 T w)",
        holds=lambda n: None if n <= 8 * T * w else f"your largest tensor holds {n:,} elements = "
        f"{n / (T * w):.0f} T w; the limit is 8 T w = {8 * T * w:,}", output="the size of your largest tensor",
        trace=False))   # a property: no reference run needed (the forms were checked at every size above)
    return found


def grads(fn, q, k, v, dy, w):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, w)
    return list(torch.autograd.grad((out * dy).sum(), (q, k, v)))


def patched_logits(answer, model, idx):
    with patched(orthros, blocked_sliding_window_attention=answer.blocked_sliding_window_attention), torch.no_grad():
        return model(idx)[0]


class LargestTensor(TorchDispatchMode):
    """Records the most elements any tensor made by an operation holds (its storage, so a view
    costs what it views)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def largest_tensor(fn, q, k, v, w):
    with torch.no_grad(), LargestTensor() as mode:
        fn(q, k, v, w)
    return mode.largest
