"""Exercise 8, the sliding window in O(T w): the checker (the reference: orthros.py's own blocked attention)."""

from types import SimpleNamespace
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import orthros
from exercises.framework import TOLERANCE, Bug, Case, Mutant, Wrong, difference, randn, tensor_difference, tiny_model, tokens

TITLE, DIFFICULTY, MINUTES = "The sliding window in O(T w)", 4, 50
FUNCTIONS = ("blocked_sliding_window_attention",)
REFERENCE = SimpleNamespace(blocked_sliding_window_attention=orthros.blocked_sliding_window_attention)
FORBIDDEN = dict.fromkeys((orthros.reference_attention, orthros.fast_reference_attention, orthros.flex_sliding_window_attention,
                           orthros.sliding_window_block_mask, orthros.cached_sliding_window_block_mask),
                          "it computes the windowed attention this exercise asks you to write")
PAPER = "(the paper's window)"

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
MASK = "mask = in_window(q_pos, k_pos, w) & (k_pos >= 0)"
ATTEND = "    y = sdpa(q, k, v, mask, dropout_p=dropout_p)"
BUGS = [
    Bug("the padding block in front not masked", "without k_pos >= 0, the queries of block 0 also attend the w zero keys "
        "of the padding (score 0, value 0): their softmax is diluted.", {MASK: "mask = in_window(q_pos, k_pos, w)"}),
    Bug("each block attends its own keys only", "a query early in its block needs keys of the previous block too: query "
        "t sees t-w+1 ... t, which crosses the block boundary unless t is the block's last.",
        {MASK: "mask = in_window(q_pos, k_pos, w) & (k_pos >= blk * w)"}),
    Bug("the dense (T, T) mask", "the mask alone holds T^2 entries: O(T^2) memory, the cost the blocked path exists to "
        "avoid (and its dropout draws another mask than one call over the blocks does).",
        {"from orthros import in_window": "from orthros import attention_mask, in_window",
         SHAPES: "    mask = attention_mask(q.size(-2), k.size(-2), window)   # (T, T)\n    return "
                 "F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)\n"}),
]
MUTANTS = [
    Mutant("the dense reference called", "your code called orthros.reference_attention",
           source="import orthros\n\n\ndef blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):\n"
                  "    return orthros.reference_attention(q, k, v, window, dropout_p)\n"),
    Mutant("fast_reference_attention captured at import", "holds orthros.fast_reference_attention",
           source="import orthros\n\n_attention = orthros.fast_reference_attention\n\n\n"
                  "def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):\n"
                  "    return _attention(q, k, v, window, 'dense', dropout_p)\n"),
    Mutant("q changed in place", "changed its input `q` in place", {SHAPES: "    q = q.mul_(2.0) / 2.0   # the same numbers\n" + SHAPES}),
    Mutant("the paper's window hard-coded (128)", "query 1 (your first wrong row) is the attention over keys 0 ... 1; eq. 4 "
           "with window=1 gives it keys 1 ... 1", {"    w = window\n": "    w = 128\n"}),
    Mutant("blocks of the paper's 128 keys, whatever the window", "eq. 4 with window=200 gives it keys",
           {"    w = window\n": "    w = 128   # blocks of 128\n", "in_window(q_pos, k_pos, w)": "in_window(q_pos, k_pos, window)"}),
    Mutant("the scores not scaled by 1/sqrt(D)", "scores scaled by 1, not 1/sqrt(D)",
           {ATTEND: "    scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float('-inf'))\n"
                    "    y = F.dropout(torch.softmax(scores, dim=-1), dropout_p) @ v"}),
    Mutant("the softmax written out, its additive mask in the default dtype (float32)", "in bfloat16",
           {ATTEND: "    bias = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float('-inf'))   # 0: seen\n"
                    "    scores = q @ k.transpose(-2, -1) / math.sqrt(D) + bias\n"
                    "    y = F.dropout(torch.softmax(scores, dim=-1), dropout_p) @ v"}),
    Mutant("dropout_p not passed on", "equals the output without dropout", {"mask, dropout_p=dropout_p)": "mask)"}),
    Mutant("computed in float64 (.double())", "your output has dtype torch.float64, expected torch.float32",
           {SHAPES: "    q, k, v = q.double(), k.double(), v.double()\n" + SHAPES}),
    Mutant("the positions made on the CPU", "is not on the expected device meta",
           {"torch.arange(n_blocks, device=q.device)": "torch.arange(n_blocks)", "torch.arange(w, device=q.device)": "torch.arange(w)",
            "torch.arange(2 * w, device=q.device)": "torch.arange(2 * w)"}),
    Mutant("q.view when T is whole blocks", "view size is not compatible",
           {"q = F.pad(q, (0, 0, 0, pad)).reshape(": "q = (F.pad(q, (0, 0, 0, pad)) if pad else q).view("}),
    Mutant("the softmax written out, without subtracting each row's max", "magnitude 1000",
           {ATTEND: "    weights = (q @ k.transpose(-2, -1) / math.sqrt(D)).exp() * mask\n"
                    "    y = F.dropout(weights / weights.sum(-1, keepdim=True), dropout_p) @ v"}),
    Mutant("a shortcut for w >= T that forgets dropout", "window=8, dropout_p=0.5)", {SHAPES: SHAPES + "    if window >= T:"
           "   # one block: plain causal attention\n        return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"}),
    Mutant("the attention in float32, for bfloat16's sake", "does a step run in another dtype?",
           {SHAPES: "    dtype = q.dtype\n    q, k, v = q.float(), k.float(), v.float()   # bfloat16 is too coarse\n" + SHAPES,
            "[:, :, :T]": "[:, :, :T].to(dtype)"}),
    Mutant("the band mask remembered per size, whatever the device", "after the same T and w on the CPU",
           {"\ndef blocked_": "\n_BANDS = {}   # one band mask per size\n\n\ndef blocked_",
            MASK: "mask = _BANDS.setdefault((n_blocks, w), in_window(q_pos, k_pos, w) & (k_pos >= 0))"}),
]
SIZES = [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (3, 8), (8, 4), (9, 4), (21, 8), (32, 8), (64, 64), (100, 7)]
EQ4 = "equal to orthros.reference_attention: query t attends exactly keys t-w+1 ... t (eq. 4)"
# (T, w, (B, H, D), dtype, views), after SIZES: another shape, float32, bfloat16, inputs that are views (as the model's
# q, k, v are), the paper's window, a window above it
MORE = [(6, 4, (1, 1, 6), None, False), (9, 4, (2, 3, 4), torch.float32, False), (9, 4, (2, 3, 4), torch.bfloat16, False),
        (12, 4, (3, 2, 8), None, True), (300, 128, (1, 2, 8), None, False), (300, 200, (1, 1, 4), None, False)]
CALL = "blocked_sliding_window_attention(q, k, v, window={})"


def qkv(B, H, T, D, seed, views=False, names="qkv"):
    """q, k, v: (B, H, T, D) float64; views=True: transposed views of (B, T, H, D) tensors, not contiguous."""
    return {name: randn(B, T, H, D, seed=seed + i).transpose(1, 2) if views else randn(B, H, T, D, seed=seed + i)
            for i, name in enumerate(names)}


def cases(**options):
    for T, w, (B, H, D), dtype, views in [(T, w, (2, 3, 4), None, False) for T, w in SIZES] + MORE:
        yield Case(f"{CALL.format(w)}, q, k, v of shape ({B}, {H}, {T}, {D})" + (f" {PAPER}" if w == 128 else "") +
                   (", transposed views of (B, T, H, D) tensors (not contiguous), as the model passes them" if views else ""),
                   dict(**qkv(B, H, T, D, T * 100 + w, views), window=w), explained, EQ4 + ", forward", dtype=dtype)
    yield from [Case(f"{CALL.format(w)[:-1]}, dropout_p=0.5) right after torch.manual_seed(0), q, k, v of shape (2, 3, {T}, 4)",
                     dict(**qkv(2, 3, T, 4, 7), window=w, dropout_p=0.5), with_dropout, "orthros.py's output under the same "
                     "seed: dropout on the attention weights, the dropout_p passed on to scaled_dot_product_attention (one call "
                     "over all the blocks, (B*H, n, w, 2w) weights as in hint 2, draws the mask orthros.py's draws)")
                for T, w in ((9, 4), (8, 4), (3, 8))]
    yield Case(f"{CALL.format(4)}, q, k, v of shape (2, 3, 9, 4), q and k of magnitude 1000 (scores in the millions)",
               dict(**{name: x * (1000 if name in "qk" else 1) for name, x in qkv(2, 3, 9, 4, 5).items()}, window=4),
               explained, f"{EQ4}; a softmax subtracts each row's max (exp of a large score overflows)")
    for T, w in SIZES[2::2]:
        yield Case(f"the gradients of ({CALL.format(w)} * dy).sum() with respect to q, k, v, all of shape (2, 3, {T}, 4)",
                   dict(**qkv(2, 3, T, 4, T * 100 + w, names="qkvd"), window=w), grads, EQ4 + ", backward: the same "
                   "gradients", output="your gradients")
    for attn in ("swa", "orthros"):
        yield Case(f"whole-model logits, attn={attn!r}, swa_impl='blocked', T=27, w=4, with yours patched into orthros.py",
                   dict(model=tiny_model(attn, window=4, swa_impl="blocked"), idx=tokens(2, 27)), patched_logits,
                   "the model's logits are unchanged with your function as its sliding window", output="the model's logits")
    T, w = 4096, 128
    yield Case(f"the largest tensor created during {CALL.format(w)}, q, k, v of shape (1, 1, {T}, 4)",
               dict(**qkv(1, 1, T, 4, 0), window=w), largest_tensor, output="the size of your largest tensor",
               invariant="O(T w) memory: no intermediate tensor holds more than 8 T w elements (the dense mask: T^2 = 32 T w)",
               holds=lambda n: None if n <= 8 * T * w else f"your largest tensor holds {n:,} elements = {n / (T * w):.0f} T w; "
                                                           f"the limit is 8 T w = {8 * T * w:,}")
    yield Case(f"{CALL.format(128)} on the meta device, q, k, v of shape (2, 6, 300, 128): the paper's heads and head size, "
               "after the same T and w on the CPU above (nothing made for that call fits here)",
               lambda: dict(**{name: torch.empty(2, 6, 300, 128) for name in "qkv"}, window=128),
               "blocked_sliding_window_attention", "the output and everything it needs are made where q is (here: meta, "
               "where only shapes exist), its shape (B, H, T, D)", device="meta")


def explained(answer, q, k, v, window):
    """The answer's output; when its values are not eq. 4's, what its first wrong query row is (a wrong form: the
    framework reports it)."""
    out, right = answer.blocked_sliding_window_attention(q, k, v, window), orthros.reference_attention(q, k, v, window)
    problem = not difference(out, right, values=False) and tensor_difference(out, right)
    if problem:
        raise Wrong(f"{problem}\n  what yours computes: {first_wrong_row(out, right, q, k, v, window)}")
    return out


def first_wrong_row(out, right, q, k, v, window):
    """Which keys j ... t, and which score scale, the first wrong query row t of out is the attention over, in words."""
    atol = TOLERANCE[right.dtype]   # the first row the comparison finds wrong, at its own tolerance
    bad = ~torch.isclose(out, right, rtol=atol if right.dtype == torch.bfloat16 else 0, atol=atol, equal_nan=True)
    t = int(bad.flatten(0, 1).any(-1).any(0).nonzero()[0])
    eq4 = f"eq. 4 with window={window} gives it keys {max(0, t - window + 1)} ... {t}"
    tol = {torch.float32: 1e-3, torch.bfloat16: 5e-2}.get(out.dtype, 1e-6)
    out, q, k, v = (x.detach().double() for x in (out, q, k, v))
    for scale, words in ((1.0, ""), (q.size(-1) ** 0.5, ", its scores scaled by 1, not 1/sqrt(D)")):
        for j in range(t + 1):
            row = orthros.reference_attention(q[:, :, t:t + 1] * scale, k[:, :, j:t + 1], v[:, :, j:t + 1])[:, :, 0]
            if (row - out[:, :, t]).abs().max() <= tol:
                return f"query {t} (your first wrong row) is the attention over keys {j} ... {t}{words}; {eq4}" + (
                    f", but its numbers are not the reference's in {right.dtype}: does a step run in another dtype?"
                    if j == max(0, t - window + 1) and not words else "")
    return f"query {t} (your first wrong row) is not the attention over any keys j ... {t}; {eq4}"


def with_dropout(answer, q, k, v, window, dropout_p):
    """The answer's output with dropout after torch.manual_seed(0); one that equals the output without dropout fails."""
    torch.manual_seed(0)
    out = answer.blocked_sliding_window_attention(q, k, v, window, dropout_p)
    if not difference(out, q, values=False) and torch.allclose(out, orthros.reference_attention(q, k, v, window)):
        raise Wrong(f"your output with dropout_p={dropout_p} equals the output without dropout: pass dropout_p on to "
                    "scaled_dot_product_attention")
    return out


def grads(answer, window, q, k, v, d):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return list(torch.autograd.grad((answer.blocked_sliding_window_attention(q, k, v, window) * d).sum(), (q, k, v)))


def patched_logits(answer, model, idx):
    with mock.patch.object(orthros, "blocked_sliding_window_attention", answer.blocked_sliding_window_attention), torch.no_grad():
        return model(idx)[0]


class LargestTensor(TorchDispatchMode):
    """Records the most elements any tensor made by an operation holds (its storage: a view costs what it views)."""
    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size() if isinstance(t, torch.Tensor) else 0)
        return out


def largest_tensor(answer, **qkv):
    with torch.no_grad(), LargestTensor() as mode:
        answer.blocked_sliding_window_attention(**qkv)
    return mode.largest
