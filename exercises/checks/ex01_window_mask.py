"""Exercise 1, the window mask: the checker, hints and known bugs. The solution is orthros.py's own."""

from types import SimpleNamespace

import torch

import orthros
from exercises.framework import Bug, Case, Mutant, patched, tiny_model, tokens, variant

TITLE = "The window mask"
DIFFICULTY = 1
MINUTES = 20
TEACHES = "eq. 4's exact boundary (key t-w+1 seen, t-w not); bottom-right alignment; one predicate behind every path"
FUNCTIONS = ("in_window", "attention_mask")
REFERENCE = SimpleNamespace(in_window=orthros.in_window, attention_mask=orthros.attention_mask)
RETURNS = {"in_window": "mask", "attention_mask": "mask"}

HINTS = [
    "Two conditions, combined with &: the key is not in the future (k_pos <= q_pos), and, when there "
    "is a window, it is one of the w most recent positions. Query t sees keys t-w+1 ... t: that is "
    "w keys, so t - j ranges over 0 ... w-1.",
    "in_window: a causal test, and with a window also a test on the distance q_pos - k_pos (0 for the "
    "query's own key, w-1 for the oldest key it sees); both are element-wise comparisons that "
    "broadcast (n_q, 1) against (1, n_k) to (n_q, n_k).\n"
    "attention_mask: the query positions are the LAST n_q of the n_k positions, n_k-n_q ... n_k-1, as a "
    "column (n_q, 1); the key positions 0 ... n_k-1 as a row (1, n_k); build both on `device`, then one "
    "call to in_window. (torch.tril, and SDPA's is_causal=True, align top-left: wrong when n_q < n_k.)",
    "Paper, section 3.1, eq. 4: o_t = sum over j = max(1, t-w+1) ... t of softmax(q_t k_j / sqrt(d)) v_j; "
    "eq. 5, the output tokens' cross-attention: j = 1 ... t. Algorithm 1, lines 8-9: "
    "Flash-Attn(Q, K, V, window_size=W) and window_size=inf.",
]


# -- Known bugs: orthros.py's two functions, each with one classic mistake ---------------------

def mask_from(predicate, top_left=False):
    def attention_mask(n_q, n_k, window=None, device=None):
        start = 0 if top_left else n_k - n_q                       # top_left: the mistake
        q_pos = torch.arange(start, start + n_q, device=device)[:, None]
        k_pos = torch.arange(n_k, device=device)[None, :]
        return predicate(q_pos, k_pos, window)
    return attention_mask


def in_window_le(q_pos, k_pos, window):
    causal = k_pos <= q_pos
    return causal if window is None else causal & (q_pos - k_pos <= window)  # <= : w+1 keys


def in_window_two_sided(q_pos, k_pos, window):
    causal = k_pos <= q_pos
    return causal if window is None else (q_pos - k_pos).abs() < window      # forgets causality


BUGS = [
    Bug("`<=` in the window", "q_pos - k_pos <= w lets query t see key t-w too: w+1 keys, one more than eq. 4.",
        SimpleNamespace(in_window=in_window_le, attention_mask=mask_from(in_window_le))),
    Bug("a two-sided window", "|q_pos - k_pos| < w lets a query see the next w-1 keys: the future leaks in.",
        SimpleNamespace(in_window=in_window_two_sided, attention_mask=mask_from(in_window_two_sided))),
    Bug("top-left alignment", "the queries were placed at positions 0 ... n_q-1 (like torch.tril or SDPA's "
        "is_causal) instead of the last n_q positions: an output token or a decoded token loses its recent keys.",
        variant(REFERENCE, attention_mask=mask_from(orthros.in_window, top_left=True))),
]


# -- Further wrong answers the checker must reject --------------------------------------------

def student_file(in_window_body, mask_body=None):
    """A whole student file: in_window with this body, attention_mask with this body (default: the
    right one, built on `device` from in_window)."""
    mask_body = mask_body or ("q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]\n"
                              "k_pos = torch.arange(n_k, device=device)[None, :]\n"
                              "return in_window(q_pos, k_pos, window)")
    indent = lambda body: "".join(f"    {line}\n" for line in body.splitlines())
    return ("import torch\n\n\ndef in_window(q_pos, k_pos, window):\n" + indent(in_window_body) +
            "\n\ndef attention_mask(n_q, n_k, window=None, device=None):\n" + indent(mask_body))


RIGHT_PREDICATE = "causal = k_pos <= q_pos\nreturn causal if window is None else causal & (q_pos - k_pos < window)"


def mask_ignoring_device(n_q, n_k, window=None, device=None):
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]                  # built on the default device
    return orthros.in_window(q_pos, torch.arange(n_k)[None, :], window)


MUTANTS = [
    Mutant("the reference imported", source="from orthros import in_window, attention_mask\n",
           expect="holds orthros.in_window"),
    Mutant("the device argument ignored", variant(REFERENCE, attention_mask=mask_ignoring_device),
           expect="your mask is on meta, expected cpu"),
    Mutant("the distance in int8", source=student_file(
        "distance = (q_pos - k_pos).to(torch.int8)   # positions are small, 8 bits will do\n"
        "causal = k_pos <= q_pos\nreturn causal if window is None else causal & (distance < window)"),
        expect="the paper's window, T=300"),
    Mutant("the distance clamped at 100", source=student_file(
        "distance = (q_pos - k_pos).clamp(max=100)   # far keys are all alike\n"
        "causal = k_pos <= q_pos\nreturn causal if window is None else causal & (distance < window)"),
        expect="outside the window, w = 128"),
    Mutant("the mask always built on the CPU", source=student_file(RIGHT_PREDICATE, (
        "q_pos = torch.arange(n_k - n_q, n_k, device='cpu')[:, None]\n"
        "k_pos = torch.arange(n_k, device='cpu')[None, :]\nreturn in_window(q_pos, k_pos, window)")),
        expect="your mask is on cpu, expected meta"),
    Mutant("device=None taken as the CPU", source=student_file(RIGHT_PREDICATE, (
        "device = device or 'cpu'\nq_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]\n"
        "k_pos = torch.arange(n_k, device=device)[None, :]\nreturn in_window(q_pos, k_pos, window)")),
        expect="the default device"),
    Mutant("the positions reshaped to a column and a row", source=student_file(
        "q_pos, k_pos = q_pos.reshape(-1, 1), k_pos.reshape(1, -1)   # (n_q, 1) and (1, n_k)\n" + RIGHT_PREDICATE),
        expect="your mask has shape (1, 1), expected ()"),
    Mutant("the queries one position too late", source=student_file(RIGHT_PREDICATE, (
        "q_pos = torch.arange(n_k - n_q + 1, n_k + 1, device=device)[:, None]   # the last n_q positions\n"
        "k_pos = torch.arange(n_k, device=device)[None, :]\nreturn in_window(q_pos, k_pos, window)")),
        expect="attention_mask(n_q=1, n_k=1, window=1)"),
    Mutant("the reference kept in a dict at import time", source=(
        "import orthros\n\n_PATHS = {'predicate': orthros.in_window}\n\n\n"
        "def in_window(q_pos, k_pos, window):\n    return _PATHS['predicate'](q_pos, k_pos, window)\n\n\n"
        "def attention_mask(n_q, n_k, window=None, device=None):\n"
        "    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]\n"
        "    return in_window(q_pos, torch.arange(n_k, device=device)[None, :], window)\n"),
        expect="your code called orthros.in_window"),
]

WINDOW = "query t sees exactly keys t-w+1 ... t (eq. 4), every key <= t without a window (eq. 5)"
FAR = ("t - j and w must be compared whole, however large: in int8 (-128 ... 127: even w = 128 wraps to -128), "
       "int16 (up to 32767) or float16 (exact only up to 2048), or clamped, a distance or the window stops being itself")


def positions_case(what, q_pos, k_pos, window, invariant=WINDOW, explain=False):
    """in_window on these positions; explain: report a difference by distance (for the large cases)."""
    return Case(f"in_window(q_pos, k_pos, window={window}) with {what}",
                inputs=lambda: dict(q_pos=q_pos.clone(), k_pos=k_pos.clone(), window=window),
                call=lambda answer, q_pos, k_pos, window: answer.in_window(q_pos, k_pos, window),
                invariant=invariant, holds=by_distance(q_pos, k_pos, window) if explain else None)


def mask_case(n_q, n_k, window, what="", invariant=None, explain=False):
    q_pos, k_pos = torch.arange(n_k - n_q, n_k)[:, None], torch.arange(n_k)[None, :]
    return Case(f"attention_mask(n_q={n_q}, n_k={n_k}, window={window}){what}",
                inputs=lambda: dict(n_q=n_q, n_k=n_k, window=window),
                call=lambda answer, n_q, n_k, window: answer.attention_mask(n_q, n_k, window),
                invariant=invariant or f"query i sits at position n_k - n_q + i (bottom-right aligned: the last "
                                       f"query is the newest position), and {WINDOW}",
                holds=by_distance(q_pos, k_pos, window) if explain else None)


def by_distance(q_pos, k_pos, window):
    """A mask's difference from eq. 4 in words, for the large cases: the first wrong (query, key) pair by
    position, and the distances t - j that yours gets wrong (a holds= of Case)."""
    q_pos, k_pos = torch.broadcast_tensors(q_pos.long(), k_pos.long())
    distance = q_pos - k_pos
    truth = (distance >= 0) & (True if window is None else distance < window)
    keys = "every key up to its own position" if window is None else f"the window, w = {window}"

    def holds(out):
        out = out.cpu()
        wrong = out != truth
        if not bool(wrong.any()):
            return None
        first = tuple(int(i) for i in wrong.nonzero()[0])
        lines = [f"{int(wrong.sum())} of {wrong.numel()} entries differ; the first at index {first}: the query at "
                 f"position t = {int(q_pos[first])} and the key at j = {int(k_pos[first])} (distance "
                 f"{int(distance[first])}): yours {bool(out[first])}, the reference {bool(truth[first])}"]
        for which, where in (("lets queries see keys", wrong & out & (distance > 0)),
                             ("lets queries see keys in their future", wrong & out & (distance < 0)),
                             ("hides keys", wrong & ~out)):
            if where.any():
                lo, hi = int(distance[where].min()), int(distance[where].max())
                side = "outside" if which.endswith("see keys") else "inside"
                lines.append(f"yours {which} at distances {lo} to {hi}" +
                             (f", {side} {keys}" if "future" not in which else ""))
        if window is not None and not (wrong & (distance < 0)).any():
            lines.append(FAR)
        return "\n    ".join(lines)
    return holds


def cases(**options):
    found = []
    for T in range(1, 7):  # the predicate on every (query, key) pair of a T x T grid
        for window in dict.fromkeys([None, 1, 2, 3, T + 1]):
            found.append(positions_case(f"q_pos = torch.arange({T})[:, None], k_pos = torch.arange({T})[None, :]",
                                        torch.arange(T)[:, None], torch.arange(T)[None, :], window))
    for n_k in range(1, 7):
        for n_q in range(1, n_k + 1):
            for window in (None, 1, 2, 3):
                found.append(mask_case(n_q, n_k, window))
    # Every form of positions orthros.py and perf/engine.py pass (the docstring: tensors that broadcast)
    pairs = torch.tensor([[5, 5], [5, 4], [5, 3], [5, 2], [2, 5], [0, 0]])
    found.append(Case(
        "in_window(q_pos, k_pos, window=3) on 0-d positions, one (q, k) pair at a time, as FlexAttention's mask_mod "
        f"calls it: (q, k) = {', '.join(f'({q}, {k})' for q, k in pairs.tolist())}",
        inputs=lambda: dict(pairs=pairs, window=3),
        call=lambda answer, pairs, window: [answer.in_window(q, k, window) for q, k in pairs],
        invariant=WINDOW, output="your masks, one per pair"))
    found.append(positions_case("1-D positions of the same shape (6,), compared pair by pair: "
                                "q_pos = torch.tensor([0, 1, 2, 5, 5, 9]), k_pos = torch.tensor([0, 0, 2, 2, 1, 9])",
                                torch.tensor([0, 1, 2, 5, 5, 9]), torch.tensor([0, 0, 2, 2, 1, 9]), 3))
    found.append(positions_case("q_pos = torch.tensor([6]) and k_pos = torch.arange(9), shapes (1,) and (9,), as "
                                "perf/engine.py's decode step asks for one new token",
                                torch.tensor([6]), torch.arange(9), 4))
    found.append(positions_case("3-D positions of shapes (2, 3, 1) and (2, 1, 6), as the blocked path asks for "
                                "blocks of w = 3 queries against 2w keys: q_pos = 3 * b + 3 + i, k_pos = 3 * b + j",
                                torch.arange(3, 9).view(2, 3, 1), (3 * torch.arange(2)[:, None] + torch.arange(6)).view(2, 1, 6), 3))
    found.append(positions_case("int32 positions: q_pos = torch.arange(7, dtype=torch.int32)[:, None], "
                                "k_pos = torch.arange(7, dtype=torch.int32)[None, :]",
                                torch.arange(7, dtype=torch.int32)[:, None], torch.arange(7, dtype=torch.int32)[None, :], 3))
    T, w, t_out = 21, 4, 5
    for attn, swa_impl, k in [("orthros", "dense", t_out), ("orthros", "blocked", t_out), ("swa", "dense", T),
                              ("swa", "blocked", T), ("orthros", "blocked", T)]:
        found.append(logits_case(attn, swa_impl, T, w, k))
    # The paper's sizes: w = 128 over T = 300 (one block of 128 and a partial one); distances past 127
    found.append(positions_case("q_pos = torch.arange(300)[:, None], k_pos = torch.arange(300)[None, :]: the "
                                "paper's window, T=300",
                                torch.arange(300)[:, None], torch.arange(300)[None, :], 128,
                                invariant=f"{WINDOW}: distances 0 ... 127 are in, 128 ... 299 out", explain=True))
    found.append(mask_case(300, 300, 128, ": the paper's window, T=300", explain=True,
                           invariant=f"{WINDOW}: distances 0 ... 127 are in, 128 ... 299 out"))
    found.append(mask_case(10, 300, None, ": 10 output tokens attending every earlier key", explain=True))
    found.append(logits_case("orthros", "blocked", 300, 128, 37))
    found.append(mask_case(1, 4096, 128, ": a decoded token at position 4095, the paper's window", explain=True,
                           invariant=f"the last query sees the last w keys: {WINDOW}"))
    found.append(mask_case(2, 70000, 40000, ": distances past 2^15 and 2^16, a window past 2^15", explain=True,
                           invariant=f"{WINDOW}; {FAR}"))
    # The device (the last cases: the first arithmetic on 'meta' makes torch import its compiler, ~1.7 s once)
    found.append(Case(
        "attention_mask(n_q=3, n_k=5, window=2, device='cpu'), called while the default device is 'meta' "
        "(inside `with torch.device('meta'):`)",
        inputs=lambda: dict(n_q=3, n_k=5, window=2, device="cpu"),
        call=mask_with_meta_default,
        invariant="the mask is built on the device it is asked for, whatever the default device"))
    found.append(Case(
        "attention_mask(n_q=300, n_k=300, window=128, device='meta'): the paper's sizes on the device 'meta' "
        "(shapes, no values)",
        inputs=lambda: dict(n_q=300, n_k=300, window=128, device="meta"),
        call=lambda answer, n_q, n_k, window, device: answer.attention_mask(n_q, n_k, window, device),
        invariant="the mask is built on the device it is asked for (here 'meta'), not on the CPU"))
    found.append(Case(
        "attention_mask(n_q=3, n_k=5, window=2) with no device, called while the default device is 'meta' "
        "(inside `with torch.device('meta'):`)",
        inputs=lambda: dict(n_q=3, n_k=5, window=2, device=None),
        call=mask_with_meta_default,
        invariant="device=None builds the mask on the default device (here 'meta'), as torch.arange does"))
    return found


def logits_case(attn, swa_impl, T, w, t_out):
    model = tiny_model(attn, window=w, swa_impl=swa_impl)
    return Case(
        f"whole-model logits, attn={attn!r}, swa_impl={swa_impl!r}, T={T}, w={w}, t_out={t_out}, with your "
        "in_window and attention_mask patched into orthros.py",
        inputs=lambda: dict(model=model, idx=tokens(2, T), t_out=t_out),
        call=patched_logits,
        invariant="every window path of orthros.py (dense mask, blocked band mask) asks the one predicate, so "
                  "the logits follow it: the right predicate gives the model's own logits",
        atol=1e-12, output="the model's logits")


def mask_with_meta_default(answer, n_q, n_k, window, device):
    with torch.device("meta"):   # a mask built without `device` lands on meta: shapes, no values
        return answer.attention_mask(n_q, n_k, window, device)


def patched_logits(answer, model, idx, t_out):
    with patched(orthros, in_window=answer.in_window, attention_mask=answer.attention_mask), torch.no_grad():
        return model(idx, t_out=t_out)[0]
