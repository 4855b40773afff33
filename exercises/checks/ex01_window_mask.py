"""Exercise 1, the window mask: the checker, hints and known bugs. The solution is orthros.py's own."""

from types import SimpleNamespace

import torch

import orthros
from exercises.framework import Bug, Case, patched, tiny_model, tokens, variant

TITLE = "The window mask"
DIFFICULTY = 1
MINUTES = 20
TEACHES = "eq. 4's exact boundary (key t-w+1 seen, t-w not); bottom-right alignment; one predicate behind every path"
FUNCTIONS = ("in_window", "attention_mask")
REFERENCE = SimpleNamespace(in_window=orthros.in_window, attention_mask=orthros.attention_mask)

HINTS = [
    "Two conditions, combined with &: the key is not in the future (k_pos <= q_pos), and, when there "
    "is a window, it is one of the w most recent positions. Query t sees keys t-w+1 ... t: that is "
    "w keys, so t - j ranges over 0 ... w-1.",
    "in_window: causal = (k_pos <= q_pos); with a window, also the distance q_pos - k_pos must be below w "
    "(distance 0 is the query's own key, distance w-1 the oldest it sees). Combine with &.\n"
    "attention_mask: q_pos = the LAST n_q positions, torch.arange(n_k - n_q, n_k)[:, None]  (n_q, 1); "
    "k_pos = torch.arange(n_k)[None, :]  (1, n_k); then one call to in_window broadcasts to (n_q, n_k). "
    "(torch.tril, and SDPA's is_causal=True, align top-left: wrong when n_q < n_k.)",
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

WINDOW = "query t sees exactly keys t-w+1 ... t (eq. 4), every key <= t without a window (eq. 5)"


def cases(**options):
    found = []
    for T in range(1, 7):  # the predicate on every (query, key) pair of a T x T grid
        for window in dict.fromkeys([None, 1, 2, 3, T + 1]):
            found.append(Case(
                f"in_window(q_pos, k_pos, window={window}) with q_pos = torch.arange({T})[:, None], "
                f"k_pos = torch.arange({T})[None, :]",
                lambda impl, T=T, window=window: impl.in_window(torch.arange(T)[:, None], torch.arange(T)[None, :], window),
                WINDOW))
    for n_k in range(1, 7):
        for n_q in range(1, n_k + 1):
            for window in (None, 1, 2, 3):
                found.append(Case(
                    f"attention_mask(n_q={n_q}, n_k={n_k}, window={window})",
                    lambda impl, n_q=n_q, n_k=n_k, window=window: impl.attention_mask(n_q, n_k, window),
                    f"query i sits at position n_k - n_q + i (bottom-right aligned: the last query is the "
                    f"newest position), and {WINDOW}"))
    T, w, t_out = 21, 4, 5
    idx = tokens(2, T)
    for attn, swa_impl, k in [("orthros", "dense", t_out), ("orthros", "blocked", t_out), ("swa", "dense", T),
                              ("swa", "blocked", T), ("orthros", "blocked", T)]:
        model = tiny_model(attn, window=w, swa_impl=swa_impl)
        found.append(Case(
            f"whole-model logits, attn={attn!r}, swa_impl={swa_impl!r}, T={T}, w={w}, t_out={k}, with your "
            "in_window and attention_mask patched into orthros.py",
            lambda impl, model=model, k=k: patched_logits(impl, model, idx, k),
            "every window path of orthros.py (dense mask, blocked band mask) asks the one predicate, so the "
            "logits follow it: the right predicate gives the model's own logits", atol=1e-12))
    return found


def patched_logits(impl, model, idx, t_out):
    with patched(orthros, in_window=impl.in_window, attention_mask=impl.attention_mask), torch.no_grad():
        return model(idx, t_out=t_out)[0]
