"""Exercise 1, the window mask: the checker. The reference is orthros.py's own in_window and attention_mask."""

from types import SimpleNamespace
from unittest import mock

import torch

import orthros
from exercises.framework import Bug, Case, Mutant, tiny_model, tokens

TITLE, DIFFICULTY, MINUTES = "The window mask", 1, 20
FUNCTIONS = ("in_window", "attention_mask")
REFERENCE = SimpleNamespace(in_window=orthros.in_window, attention_mask=orthros.attention_mask)
PAPER = "the paper's window, T=300"

HINTS = [
    "Two conditions, combined with &: the key is not in the future (k_pos <= q_pos), and, when there is a window, it "
    "is one of the w most recent positions. Query t sees keys t-w+1 ... t: that is w keys, so t - j ranges over 0 ... "
    "w-1.",
    "in_window: a causal test, and with a window also a test on the distance q_pos - k_pos (0 for the query's own key,"
    " w-1 for the oldest key it sees); both are element-wise comparisons that broadcast (n_q, 1) against (1, n_k) to "
    "(n_q, n_k).\n"
    "attention_mask: the query positions are the LAST n_q of the n_k positions, n_k-n_q ... n_k-1, as a column (n_q, "
    "1); the key positions 0 ... n_k-1 as a row (1, n_k); build both on `device`, then one call to in_window. "
    "(torch.tril, and SDPA's is_causal=True, align top-left: wrong when n_q < n_k.)",
    "Paper, section 3.1, eq. 4: o_t = sum over j = max(1, t-w+1) ... t of softmax(q_t k_j / sqrt(d)) v_j; eq. 5, the "
    "output tokens' cross-attention: j = 1 ... t. Algorithm 1, lines 8-9: Flash-Attn(Q, K, V, window_size=W) and "
    "window_size=inf.",
]

WINDOWED = "causal & (q_pos - k_pos < window)"
QUERIES = "torch.arange(n_k - n_q, n_k, device=device)"
KEYS = "torch.arange(n_k, device=device)"
BUGS = [
    Bug("`<=` in the window", "q_pos - k_pos <= w lets query t see key t-w too: w+1 keys, one more than eq. 4.",
        {WINDOWED: "causal & (q_pos - k_pos <= window)"}),
    Bug("a two-sided window", "|q_pos - k_pos| < w lets a query see the next w-1 keys: the future leaks in.",
        {WINDOWED: "(q_pos - k_pos).abs() < window"}),
    Bug("the window ignored", "a window w lets query t see only keys t-w+1 ... t (eq. 4); every key <= t is window=None's "
        "rule (eq. 5).", {f"causal if window is None else {WINDOWED}": "causal"}),
    Bug("top-left alignment", "the queries sit at the LAST n_q positions (torch.tril and SDPA's is_causal put them first): "
        "an output token or a decoded token would lose its recent keys.", {QUERIES: "torch.arange(n_q, device=device)"}),
    Bug("the distance aliased and written in place", "`distance = q_pos` names the caller's tensor: `distance -= k_pos` "
        "writes into q_pos. Write distance = q_pos - k_pos.",
        {"    causal = k_pos <= q_pos": "    distance = q_pos\n    distance -= k_pos\n    causal = k_pos <= q_pos",
         WINDOWED: "causal & (distance < window)"}),
]
MUTANTS = [
    Mutant("the reference imported", "holds orthros.in_window", source="from orthros import in_window, attention_mask\n"),
    Mutant("the reference kept in a dict at import time", "your code called orthros.in_window",
           {"import torch\n": "import torch\n\nimport orthros\n\n_PATHS = {'predicate': orthros.in_window}\n",
            f"return causal if window is None else {WINDOWED}": "return _PATHS['predicate'](q_pos, k_pos, window)"}),
    Mutant("the device argument ignored", "your mask is on meta, expected cpu",
           {QUERIES: "torch.arange(n_k - n_q, n_k)", KEYS: "torch.arange(n_k)"}),
    Mutant("the distance in int8", PAPER, {WINDOWED: "causal & ((q_pos - k_pos).to(torch.int8) < window)"}),
    Mutant("the distance clamped at 100", "or clamped", {WINDOWED: "causal & ((q_pos - k_pos).clamp(max=100) < window)"}),
    Mutant("the mask always built on the CPU", "your mask is on cpu, expected meta",
           {QUERIES: "torch.arange(n_k - n_q, n_k, device='cpu')", KEYS: "torch.arange(n_k, device='cpu')"}),
    Mutant("device=None taken as the CPU", "the default device", {"    q_pos = torch": "    device = device or 'cpu'\n    q_pos = torch"}),
    Mutant("the positions reshaped to a column and a row", "your mask has shape (1, 1), expected ()",
           {"    causal = k_pos": "    q_pos, k_pos = q_pos.reshape(-1, 1), k_pos.reshape(1, -1)\n    causal = k_pos"}),
    Mutant("the queries one position too late", "attention_mask(n_q=1, n_k=1, window=1)",
           {QUERIES: "torch.arange(n_k - n_q + 1, n_k + 1, device=device)"}),
    Mutant("attention_mask cached with functools.lru_cache: every caller shares one tensor", "changed the first mask in place",
           {"import torch\n": "import functools\n\nimport torch\n",
            "def attention_mask(": "@functools.lru_cache(maxsize=None)\ndef attention_mask("}),
    Mutant("window=None written as 4096", "past any fixed length", {"causal if window is None else ": "", "< window)": "< (window or 4096))"}),
    Mutant("the window dropped when n_q < n_k", "(n_q=1, n_k=2, window=1)", {"k_pos, window)\n": "k_pos, window if n_q == n_k else None)\n"}),
]
WINDOW = "query t sees exactly keys t-w+1 ... t (eq. 4), every key <= t without a window (eq. 5)"
FAR = ("t - j and w must be compared whole, however large: in int8 (-128 ... 127: even w = 128 wraps to -128), int16 "
       "(up to 32767) or float16 (exact only up to 2048), or clamped, a distance or the window stops being itself")
ALIGNED = f"query i sits at position n_k - n_q + i (bottom-right aligned: the last query is the newest position), and {WINDOW}"
ARANGE = "q_pos = torch.arange({T})[:, None], k_pos = torch.arange({T})[None, :]"
# Every form of positions orthros.py and perf/engine.py pass (the docstring: tensors that broadcast): (what, q, k, w)
FORMS = [*((f"0-d positions q_pos = torch.tensor({q}), k_pos = torch.tensor({k}), as FlexAttention's mask_mod asks one "
            "(q, k) pair at a time", torch.tensor(q), torch.tensor(k), 3) for q, k in [(5, 5), (5, 4), (5, 3), (5, 2), (2, 5), (0, 0)]),
         ("1-D positions of the same shape (6,), compared pair by pair: q_pos = torch.tensor([0, 1, 2, 5, 5, 9]), k_pos = "
          "torch.tensor([0, 0, 2, 2, 1, 9])", torch.tensor([0, 1, 2, 5, 5, 9]), torch.tensor([0, 0, 2, 2, 1, 9]), 3),
         ("q_pos = torch.tensor([6]) and k_pos = torch.arange(9), shapes (1,) and (9,), as perf/engine.py's decode step asks "
          "for one new token", torch.tensor([6]), torch.arange(9), 4),
         ("3-D positions of shapes (2, 3, 1) and (2, 1, 6), as the blocked path asks for blocks of w = 3 queries against 2w "
          "keys: q_pos = 3 * b + 3 + i, k_pos = 3 * b + j", torch.arange(3, 9).view(2, 3, 1),
          (3 * torch.arange(2)[:, None] + torch.arange(6)).view(2, 1, 6), 3),
         ("int32 positions: q_pos = torch.arange(7, dtype=torch.int32)[:, None], k_pos = torch.arange(7, dtype=torch.int32)"
          "[None, :]", torch.arange(7, dtype=torch.int32)[:, None], torch.arange(7, dtype=torch.int32)[None, :], 3)]
META = "called while the default device is 'meta' (inside `with torch.device('meta'):`)"


def window_case(what, q_pos, k_pos, window, invariant=WINDOW):
    return Case(f"in_window(q_pos, k_pos, window={window}) with {what}", dict(q_pos=q_pos, k_pos=k_pos, window=window),
                "in_window", invariant, output="your mask")


def mask_case(n_q, n_k, window, what="", invariant=ALIGNED):
    return Case(f"attention_mask(n_q={n_q}, n_k={n_k}, window={window}){what}", dict(n_q=n_q, n_k=n_k, window=window),
                "attention_mask", invariant, output="your mask")


def logits_case(attn, swa_impl, T, w, t_out):
    model = tiny_model(attn, window=w, swa_impl=swa_impl)
    return Case(f"whole-model logits, attn={attn!r}, swa_impl={swa_impl!r}, T={T}, w={w}, t_out={t_out}, with your in_window "
                "and attention_mask patched into orthros.py", dict(model=model, idx=tokens(2, T), t_out=t_out), patched_logits,
                "every window path of orthros.py (dense mask, blocked band mask) asks the one predicate: the right one gives "
                "the model's own logits", output="the model's logits")


def cases(**options):
    yield from [window_case(ARANGE.format(T=T), torch.arange(T)[:, None], torch.arange(T)[None, :], window)
                for T in range(1, 7) for window in dict.fromkeys([None, 1, 2, 3, T + 1])]
    yield from [mask_case(n_q, n_k, window) for n_k in range(1, 7) for n_q in range(1, n_k + 1) for window in (None, 1, 2, 3)]
    yield from [window_case(*form) for form in FORMS]
    yield from [logits_case(attn, swa_impl, 21, 4, t_out) for attn, swa_impl, t_out in [
        ("orthros", "dense", 5), ("orthros", "blocked", 5), ("swa", "dense", 21), ("swa", "blocked", 21), ("orthros", "blocked", 21)]]
    yield Case("attention_mask(n_q=3, n_k=5, window=2), called again after the caller changed the first mask in place "
               "(mask.fill_(False)): yours must make a new mask each call", dict(n_q=3, n_k=5, window=2),
               lambda answer, **asked: (answer.attention_mask(**asked).fill_(False), answer.attention_mask(**asked))[1],
               "a call's result is the caller's own tensor: what the caller does with it changes no later call",
               output="your second mask")
    # The paper's sizes: w = 128 over T = 300 (a block of 128 and a partial one); distances past 127, 2^15 and 2^16
    paper = f"{WINDOW}: distances 0 ... 127 are in, 128 ... 299 out; {FAR}"
    yield window_case(f"{ARANGE.format(T=300)}: {PAPER}", torch.arange(300)[:, None], torch.arange(300)[None, :], 128, paper)
    yield mask_case(300, 300, 128, f": {PAPER}", paper)
    yield mask_case(10, 300, None, ": 10 output tokens attending every earlier key")
    yield window_case("0-d positions q_pos = torch.tensor(2**40), k_pos = torch.tensor(0): a distance past any fixed length",
                      torch.tensor(2 ** 40), torch.tensor(0), None, f"window=None has no length: {WINDOW}")
    yield logits_case("orthros", "blocked", 300, 128, 37)
    yield mask_case(1, 4096, 128, ": a decoded token at position 4095, the paper's window", f"the last query sees the last w "
                    f"keys: {WINDOW}")
    yield mask_case(2, 70000, 40000, ": distances past 2^15 and 2^16, a window past 2^15", f"{WINDOW}; {FAR}")
    # The device (last: the first arithmetic on 'meta' makes torch import its compiler, ~1.7 s once per process)
    for n_q, n_k, w, device, where, invariant in [
            (3, 5, 2, "cpu", f"device='cpu'), {META}", "the mask is built on the device it is asked for, whatever the default"),
            (300, 300, 128, "meta", "device='meta'): the paper's sizes on the device 'meta' (shapes, no values)",
             "the mask is built on the device it is asked for (here 'meta'), not on the CPU"),
            (3, 5, 2, None, f"no device, {META}", "device=None builds the mask on the default device (here 'meta'), as "
                                                  "torch.arange does")]:
        yield Case(f"attention_mask(n_q={n_q}, n_k={n_k}, window={w}, {where}", dict(n_q=n_q, n_k=n_k, window=w,
                   device=device), meta_default, invariant, output="your mask")


def meta_default(answer, **asked):
    with torch.device("meta"):   # a mask built without `device` lands on meta: shapes, no values
        return answer.attention_mask(**asked)


def patched_logits(answer, model, idx, t_out):
    with mock.patch.multiple(orthros, in_window=answer.in_window, attention_mask=answer.attention_mask), torch.no_grad():
        return model(idx, t_out=t_out)[0]
