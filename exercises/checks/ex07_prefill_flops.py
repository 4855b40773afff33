"""Exercise 7, prefill FLOPs: the checker."""

import dataclasses
import timeit
from types import SimpleNamespace
from unittest import mock

import torch

from exercises.framework import Bug, Case, Mutant, change
from exercises.solutions import ex07_prefill_flops as solution
from orthros import Orthros, OrthrosConfig
from perf import flops

TITLE, DIFFICULTY, MINUTES = "Prefill FLOPs", 3, 35
FUNCTIONS = ("attended_pairs", "prefill_flops")
REFERENCE = SimpleNamespace(attended_pairs=flops.attended_pairs, prefill_flops=solution.prefill_flops)
FORBIDDEN = dict.fromkeys((flops.forward_flops, flops.prefill_flop_limits, flops.train_flops),
                          "perf/flops.py's FLOP count, which the checker compares yours with: count them yourself")
PAPER = "T=300), orthros, the paper's"

HINTS = [
    "Count pairs row by row. Without a window, the query at position t sees t + 1 keys; the last n_q queries are t = "
    "T-n_q ... T-1. With a window, the first w queries see 1, 2, ..., w keys and every later one exactly w (careful "
    "when w > T). Then FLOPs: every token in a layer pays the token-wise matrices; Orthros's prefill has T base tokens"
    " and ONE output token, which has a query but no key.",
    "attended_pairs, no window: the last n_q queries sit at T-n_q ... T-1 and see t + 1 keys each: an arithmetic "
    "series, n_q terms from T-n_q+1 up to T. With a window: the first min(w, T) queries see 1, 2, ... keys (a "
    "triangle), every later one exactly w. Integers only: // not /.\n"
    "prefill_flops, per layer, in FLOPs: (tokens through the layer) x 20 C^2, plus (base tokens) x 4 C^2 for W_K, W_V, "
    "plus 4 C per attended pair; the pairs are causal for the Transformer, windowed for SWA and Orthros's base tokens,"
    " plus the one output query's full row for Orthros. Times n_layer, plus 2 C V for the LM head at the one position "
    "with logits.",
    "Paper, section 3.3 (Complexity Analysis): sliding window attention O(TWd), full cross-attention O(T_out T d), "
    "token-wise projections O((T + T_out) d^2); prefilling has T_out = 1. In the repo: perf/flops.py, forward_flops "
    "and prefill_flop_limits.",
]


LOADED = "    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size\n"
SOLUTION = "def attended_pairs("
WINDOWED = "return w * (w + 1) // 2 + (T - w) * window"
TOKENWISE = "tokenwise = 2 * (10 * C * C * n_tokens + 2 * C * C * T)"
BUGS = [
    Bug("every query counted with w keys", "T * w overcounts: query t < w has only t + 1 keys (w(w+1)/2 pairs for the "
        "first w queries), and with w > T no query has w.", {WINDOWED: "return T * window"}),
    Bug("W_K, W_V on the output token too", "keys and values come from base tokens only: the output token pays W_Q, W_O "
        "and the MLP (10 C^2), not W_K, W_V.", {TOKENWISE: "tokenwise = 2 * 12 * C * C * n_tokens"}),
    Bug("the matrices' multiply-adds counted as FLOPs", "a C x C matrix costs a token C^2 multiply-adds, 2 C^2 FLOPs: 20 C^2 "
        "and 4 C^2 FLOPs a token, not 10 C^2 and 2 C^2.", {TOKENWISE: "tokenwise = 10 * C * C * n_tokens + 2 * C * C * T"}),
    Bug("the LM head on all T tokens", "prefill returns logits at the last position only (t_out = 1): 2 C V, not 2 C V T.",
        {"+ 2 * C * V": "+ 2 * C * V * T"}),
]
MUTANTS = [
    Mutant("flops.forward_flops returned", "your code called perf.flops.forward_flops",
           {SOLUTION: "from perf import flops\n\n\n" + SOLUTION, LOADED: "    return flops.forward_flops(cfg, T, 1)\n"}),
    Mutant("flops.forward_flops captured at import", "holds perf.flops.forward_flops",
           {SOLUTION: "from perf.flops import forward_flops as _count\n\n\n" + SOLUTION, LOADED: "    return _count(cfg, T, 1)\n"}),
    Mutant("perf/flops.py's attended_pairs imported for prefill_flops", "holds perf.flops.attended_pairs",
           {SOLUTION: "from perf.flops import attended_pairs as pairs\n\n\n" + SOLUTION}),
    Mutant("attended_pairs: n_q ignored", "the last 1 of T=2 queries", {"    n_q = T if n_q is None else n_q\n": "    n_q = T\n"}),
    Mutant("attended_pairs: the window not clamped to T", "yours 0, the reference 1", {"w = min(window, T)": "w = window"}),
    Mutant("attended_pairs: / for //", "your pair count is a float", {"n_q * (n_q - 1) // 2": "n_q * (n_q - 1) / 2"}),
    Mutant("the paper's window hard-coded (128)", "as cfg.window goes from 4 to 5",
           {"attended_pairs(T, cfg.window)": "attended_pairs(T, 128)"}),
    Mutant("the paper's 12 layers hard-coded", "as cfg.n_layer goes from 2 to 3", {LOADED: LOADED.replace("cfg.n_layer", "12")}),
    Mutant("n_head for n_layer", "as cfg.n_head goes from 2 to 1", {LOADED: LOADED.replace("cfg.n_layer", "cfg.n_head")}),
    Mutant("4 head_dim per pair, not 4 C", "as cfg.n_head goes from 2 to 1", {"4 * C * pairs": "4 * (C // cfg.n_head) * pairs"}),
    Mutant("SWA counted with an output token", "as cfg.attn goes from 'orthros' to 'swa'",
           {'T + 1 if cfg.attn == "orthros"': 'T + 1 if cfg.attn != "transformer"',
            'if cfg.attn == "orthros":\n': 'if cfg.attn != "transformer":\n'}),
    Mutant("the LM head left out", "as cfg.vocab_size goes from 37 to 38", {" + 2 * C * V": ""}),
]
SIZES = {"tiny (2 x 16, 2 heads, w=4, V=37)": OrthrosConfig(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4),
         "odd (3 x 48, 4 heads, w=7, V=101)": OrthrosConfig(vocab_size=101, n_layer=3, n_head=4, n_embd=48, window=7),
         "bench --tiny (2 x 128, 2 heads, w=16, V=4096)": OrthrosConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=128, window=16),
         "the paper's (12 x 768, 6 heads, w=128, V=50304)": OrthrosConfig()}
ATTNS = ("transformer", "swa", "orthros")
# How the count of T=5 tokens must move when one field of the tiny config changes (the base config's attn, then the field,
# from, to): exactly as perf/flops.py's does, 0 where that does not depend on the field
PROBES = [("transformer", "n_head", 2, 1), ("transformer", "n_layer", 2, 3), ("transformer", "vocab_size", 37, 38),
          ("transformer", "n_embd", 16, 32), ("swa", "window", 4, 5), ("orthros", "attn", "orthros", "swa")]


def cases(**options):
    calls = [c for T in (1, 2, 3, 4, 5, 8, 100) for c in [(T, None, None)] + [(T, w, None) for w in (1, 2, 3, 8)] +
             [(T, None, n_q) for n_q in sorted({1, 2, T // 2, T} & set(range(1, T + 1)))]]
    calls += [(T, 128, None) for T in (127, 128, 129, 300)] + [(300, None, n) for n in (1, 128, 300)]
    yield from [Case(f"attended_pairs(T={T}, window={window}, n_q={n_q})" + (" (the paper's window)" if window == 128 else ""),
                     dict(T=T, window=window, n_q=n_q), "attended_pairs", f"the last {n_q or T} of T={T} queries (t = "
                     f"{T - (n_q or T)} ... {T - 1}) each see " + ("t + 1 keys" if window is None else f"min(t + 1, "
                     f"w={window}) keys") + ", summed", output="your pair count") for T, window, n_q in calls]
    configs = [(name, dataclasses.replace(cfg, attn=attn)) for name, cfg in SIZES.items() for attn in ATTNS]
    for name, cfg in configs:
        yield from [Case(f"flops.forward_flops(cfg, T={T}, t_out={t_out}), {cfg.attn}, {name}, with your attended_pairs "
                         "patched into perf/flops.py", dict(cfg=cfg, T=T, t_out=t_out), patched_forward_flops, "perf/flops.py's "
                         "FLOP counts (prefill, SFT, pre-training) are unchanged with your attended_pairs",
                         output="flops.forward_flops's count") for T, t_out in ((7, 7), (300, 1), (300, 40))]
    tiny = SIZES["tiny (2 x 16, 2 heads, w=4, V=37)"]
    for attn, field, old, new in PROBES:
        cfg = dataclasses.replace(tiny, attn=attn)
        yield Case(f"prefill_flops(cfg, T=5) as cfg.{field} goes from {old!r} to {new!r}: the change of the count, the tiny "
                   f"config, {attn}", dict(cfg=cfg, changed=dataclasses.replace(cfg, **{field: new})),
                   lambda answer, cfg, changed: change(answer.prefill_flops(cfg, 5), answer.prefill_flops(changed, 5)),
                   f"your count changes with cfg.{field} exactly as perf/flops.py's does", output="the change of your count",
                   expected=lambda cfg, changed: flops.forward_flops(changed, 5, 1) - flops.forward_flops(cfg, 5, 1))
    yield from [Case(f"prefill_flops(cfg, T={T}), {cfg.attn}, {name}", dict(cfg=cfg, T=T), "prefill_flops", "exactly "
                     "flops.forward_flops(cfg, T, 1): token-wise matrices on every token (Orthros: T + 1), W_K, W_V on the T "
                     "base tokens, 4C per attended pair, the LM head (2 C V) at one position", output="your FLOP count",
                     expected=lambda cfg, T: flops.forward_flops(cfg, T, 1))
                for name, cfg in configs for T in (1, 3, 4, 5, 7, 8, 100, 127, 128, 129, 300, 32768, 262144)]


def patched_forward_flops(answer, cfg, T, t_out):
    with mock.patch.multiple(flops, attended_pairs=answer.attended_pairs):
        return flops.forward_flops(cfg, T, t_out)


def after_pass(answer, **options):
    """The FLOP limit of Orthros's prefill speedup (your count) next to a measured one on this CPU."""
    cfg = SIZES["bench --tiny (2 x 128, 2 heads, w=16, V=4096)"]
    cfgs = {attn: dataclasses.replace(cfg, attn=attn, max_seq_len=4096) for attn in ("transformer", "orthros")}
    models = {attn: Orthros(c).eval() for attn, c in cfgs.items()}
    lines = ["Prefill, Orthros against the Transformer, at perf/bench.py's --tiny size (2 layers, C=128, w=16), float32, 1 "
             "CPU thread, the fastest of 3 runs:", f"  {'T':>6} {'FLOP-limit speedup':>19} {'measured speedup':>17}"]
    for T in (1024, 2048, 4096):
        flops = {attn: answer.prefill_flops(c, T) for attn, c in cfgs.items()}
        idx = torch.randint(0, cfg.vocab_size, (1, T))
        seconds = {attn: min(timeit.repeat(lambda: m.prefill(idx), number=1, repeat=3)) for attn, m in models.items()}
        lines.append(f"  {T:>6} {flops['transformer'] / flops['orthros']:>18.2f}x "
                     f"{seconds['transformer'] / seconds['orthros']:>16.2f}x")
    return "\n".join(lines + ["  The measured speedup is printed, never checked: it depends on the machine and its load."])
