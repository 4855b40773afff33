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


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

def mask_ignoring_device(n_q, n_k, window=None, device=None):
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]                  # built on the default device
    return orthros.in_window(q_pos, torch.arange(n_k)[None, :], window)


MUTANTS = [
    Mutant("the reference imported", source="from orthros import in_window, attention_mask\n",
           expect="holds orthros.in_window"),
    Mutant("the device argument ignored", variant(REFERENCE, attention_mask=mask_ignoring_device),
           expect="your mask is on meta, expected cpu"),
]

WINDOW = "query t sees exactly keys t-w+1 ... t (eq. 4), every key <= t without a window (eq. 5)"


def cases(**options):
    found = []
    for T in range(1, 7):  # the predicate on every (query, key) pair of a T x T grid
        for window in dict.fromkeys([None, 1, 2, 3, T + 1]):
            found.append(Case(
                f"in_window(q_pos, k_pos, window={window}) with q_pos = torch.arange({T})[:, None], "
                f"k_pos = torch.arange({T})[None, :]",
                inputs=lambda T=T, window=window: dict(q_pos=torch.arange(T)[:, None], k_pos=torch.arange(T)[None, :],
                                                       window=window),
                call=lambda answer, q_pos, k_pos, window: answer.in_window(q_pos, k_pos, window),
                invariant=WINDOW))
    for n_k in range(1, 7):
        for n_q in range(1, n_k + 1):
            for window in (None, 1, 2, 3):
                found.append(Case(
                    f"attention_mask(n_q={n_q}, n_k={n_k}, window={window})",
                    inputs=lambda n_q=n_q, n_k=n_k, window=window: dict(n_q=n_q, n_k=n_k, window=window),
                    call=lambda answer, n_q, n_k, window: answer.attention_mask(n_q, n_k, window),
                    invariant=f"query i sits at position n_k - n_q + i (bottom-right aligned: the last query is "
                              f"the newest position), and {WINDOW}"))
    T, w, t_out = 21, 4, 5
    for attn, swa_impl, k in [("orthros", "dense", t_out), ("orthros", "blocked", t_out), ("swa", "dense", T),
                              ("swa", "blocked", T), ("orthros", "blocked", T)]:
        model = tiny_model(attn, window=w, swa_impl=swa_impl)
        found.append(Case(
            f"whole-model logits, attn={attn!r}, swa_impl={swa_impl!r}, T={T}, w={w}, t_out={k}, with your "
            "in_window and attention_mask patched into orthros.py",
            inputs=lambda model=model, k=k: dict(model=model, idx=tokens(2, T), t_out=k),
            call=patched_logits,
            invariant="every window path of orthros.py (dense mask, blocked band mask) asks the one predicate, so "
                      "the logits follow it: the right predicate gives the model's own logits",
            atol=1e-12, output="the model's logits"))
    found.append(Case(
        "attention_mask(n_q=1, n_k=4096, window=128): a decoded token at position 4095, the paper's window",
        inputs=lambda: dict(n_q=1, n_k=4096, window=128),
        call=lambda answer, n_q, n_k, window: answer.attention_mask(n_q, n_k, window),
        invariant=f"the last query sees the last w keys: {WINDOW}"))
    found.append(Case(
        "attention_mask(n_q=3, n_k=5, window=2, device='cpu'), called while the default device is 'meta' "
        "(inside `with torch.device('meta'):`)",
        inputs=lambda: dict(n_q=3, n_k=5, window=2, device="cpu"),
        call=mask_with_meta_default,
        invariant="the mask is built on the device it is asked for, whatever the default device"))
    return found


def mask_with_meta_default(answer, n_q, n_k, window, device):
    with torch.device("meta"):   # a mask built without `device` lands on meta: shapes, no values
        return answer.attention_mask(n_q, n_k, window, device)


def patched_logits(answer, model, idx, t_out):
    with patched(orthros, in_window=answer.in_window, attention_mask=answer.attention_mask), torch.no_grad():
        return model(idx, t_out=t_out)[0]
