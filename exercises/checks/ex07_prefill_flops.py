"""Exercise 7, prefill FLOPs: the checker, hints and known bugs."""

import dataclasses
import statistics
import time
from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, patched, variant
from exercises.solutions import ex07_prefill_flops as solution
from orthros import Orthros, OrthrosConfig
from perf import bench

TITLE = "Prefill FLOPs"
DIFFICULTY = 3
MINUTES = 35
TEACHES = "why prefill is linear: T(T+1)/2 pairs against ~Tw + T; the FLOP-limit speedup against a measured one"
FUNCTIONS = ("attended_pairs", "prefill_flops")
REFERENCE = SimpleNamespace(attended_pairs=bench.attended_pairs, prefill_flops=solution.prefill_flops)
RETURNS = {"attended_pairs": "count of pairs", "prefill_flops": "FLOP count"}
BENCH = "perf/bench.py's FLOP count, which the checker compares yours with: count them yourself"
FORBIDDEN = {bench.forward_flops: BENCH, bench.prefill_flop_limits: BENCH, bench.train_flops: BENCH}

HINTS = [
    "Count pairs row by row. Without a window, the query at position t sees t + 1 keys; the last n_q "
    "queries are t = T-n_q ... T-1. With a window, the first w queries see 1, 2, ..., w keys and every "
    "later one exactly w (careful when w > T). Then FLOPs: every token in a layer pays the token-wise "
    "matrices; Orthros's prefill has T base tokens and ONE output token, which has a query but no key.",
    "attended_pairs, no window: the last n_q queries sit at T-n_q ... T-1 and see t + 1 keys each: an "
    "arithmetic series, n_q terms from T-n_q+1 up to T. With a window: the first min(w, T) queries see "
    "1, 2, ... keys (a triangle), every later one exactly w. Integers only: // not /.\n"
    "prefill_flops, per layer: (tokens through the layer) x 10 C^2 x 2, plus (base tokens) x 2 C^2 x 2 for W_K, "
    "W_V, plus 4 C per attended pair; the pairs are causal for the Transformer, windowed for SWA and "
    "Orthros's base tokens, plus the one output query's full row for Orthros. Times n_layer, plus 2 C V for the "
    "LM head at the one position with logits.",
    "Paper, section 3.3 (Complexity Analysis): sliding window attention O(TWd), full cross-attention "
    "O(T_out T d), token-wise projections O((T + T_out) d^2); prefilling has T_out = 1. In the repo: "
    "perf/bench.py, forward_flops and prefill_flop_limits.",
]


# -- Known bugs ---------------------------------------------------------------------------------

def every_query_w_keys(T, window=None, n_q=None):
    n_q = T if n_q is None else n_q
    if window is None:
        return n_q * T - n_q * (n_q - 1) // 2
    return T * window  # the first w-1 queries have fewer than w keys before them


def make_flops(kv_on_outputs=False, lm_head_all=False):
    def prefill_flops(cfg, T):
        C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
        n_tokens = T + 1 if cfg.attn == "orthros" else T
        tokenwise = 2 * 12 * C * C * n_tokens if kv_on_outputs else 2 * (10 * C * C * n_tokens + 2 * C * C * T)
        if cfg.attn == "transformer":
            pairs = bench.attended_pairs(T)
        else:
            pairs = bench.attended_pairs(T, cfg.window)
            if cfg.attn == "orthros":
                pairs += bench.attended_pairs(T, None, n_q=1)
        return L * (tokenwise + 4 * C * pairs) + 2 * C * V * (T if lm_head_all else 1)
    return prefill_flops


BUGS = [
    Bug("every query counted with w keys", "T * w overcounts: query t < w has only t + 1 keys (w(w+1)/2 pairs "
        "for the first w queries), and with w > T no query has w.", variant(REFERENCE, attended_pairs=every_query_w_keys)),
    Bug("W_K, W_V on the output token too", "keys and values come from base tokens only: the output token pays "
        "W_Q, W_O and the MLP (10 C^2), not W_K, W_V.", variant(REFERENCE, prefill_flops=make_flops(kv_on_outputs=True))),
    Bug("the LM head on all T tokens", "prefill returns logits at the last position only (t_out = 1): 2 C V, "
        "not 2 C V T.", variant(REFERENCE, prefill_flops=make_flops(lm_head_all=True))),
]


# -- Cases --------------------------------------------------------------------------------------

SIZES = {"tiny (2 x 16, w=4, V=37)": OrthrosConfig(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4),
         "bench --tiny (2 x 128, w=16, V=4096)": OrthrosConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=128, window=16),
         "the paper's (12 x 768, w=128, V=50304)": OrthrosConfig()}


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

MUTANTS = [
    Mutant("bench.forward_flops returned",
           source="from perf import bench\n\n\n"
                  "def attended_pairs(T, window=None, n_q=None):\n"
                  "    n_q = T if n_q is None else n_q\n"
                  "    if window is None:\n"
                  "        return n_q * T - n_q * (n_q - 1) // 2\n"
                  "    w = min(window, T)\n"
                  "    return w * (w + 1) // 2 + (T - w) * window\n\n\n"
                  "def prefill_flops(cfg, T):\n"
                  "    return bench.forward_flops(cfg, T, 1)\n",
           expect="your code called perf.bench.forward_flops"),
]


def cases(**options):
    found = []
    for T in (1, 2, 3, 4, 5, 8, 100):
        calls = [(T, None, None)] + [(T, w, None) for w in (1, 2, 3, 8)] + \
                [(T, None, n_q) for n_q in sorted({1, 2, T // 2, T} & set(range(1, T + 1)))]
        for T_, window, n_q in calls:
            found.append(Case(
                f"attended_pairs(T={T_}, window={window}, n_q={n_q})",
                inputs=lambda T=T_, window=window, n_q=n_q: dict(T=T, window=window, n_q=n_q),
                call=lambda answer, T, window, n_q: answer.attended_pairs(T, window, n_q),
                invariant="query t sees t + 1 keys without a window and min(t + 1, w) with one; the sum over the "
                          "last n_q queries (bench.attended_pairs)"))
    for name, cfg in SIZES.items():
        for attn in ("transformer", "swa", "orthros"):
            for T, t_out in ((7, 7), (300, 1), (300, 40)):
                found.append(Case(
                    f"bench.forward_flops(cfg, T={T}, t_out={t_out}), {attn}, {name}, with your attended_pairs "
                    "patched into perf/bench.py",
                    inputs=lambda cfg=dataclasses.replace(cfg, attn=attn), T=T, t_out=t_out: dict(cfg=cfg, T=T, t_out=t_out),
                    call=patched_forward_flops,
                    invariant="perf/bench.py's FLOP counts (prefill, SFT, pre-training) are unchanged with your "
                              "attended_pairs", output="bench.forward_flops's count"))
    for name, cfg in SIZES.items():
        for T in (1, 3, 4, 5, 100, 128, 129, 32768, 262144):
            for attn in ("transformer", "swa", "orthros"):
                found.append(Case(
                    f"prefill_flops(cfg, T={T}), {attn}, {name}",
                    inputs=lambda cfg=dataclasses.replace(cfg, attn=attn), T=T: dict(cfg=cfg, T=T),
                    call=lambda answer, cfg, T: answer.prefill_flops(cfg, T),
                    invariant="exactly bench.forward_flops(cfg, T, 1): token-wise matrices on every token (Orthros: "
                              "T + 1), W_K, W_V on the T base tokens, 4C per attended pair, the LM head at one position",
                    expected=lambda cfg, T: bench.forward_flops(cfg, T, 1)))
    return found


def patched_forward_flops(answer, cfg, T, t_out):
    with patched(bench, attended_pairs=answer.attended_pairs):
        return bench.forward_flops(cfg, T, t_out)


def median_seconds(fn, reps=3):
    fn()  # warm-up: allocator, first-call setup
    return statistics.median(timed(fn) for _ in range(reps))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def after_pass(answer, **options):
    """The FLOP limit of Orthros's prefill speedup (your count) next to a measured one on this CPU."""
    cfg = SIZES["bench --tiny (2 x 128, w=16, V=4096)"]
    lines = ["Prefill, Orthros against the Transformer, at perf/bench.py's --tiny size (2 layers, C=128, w=16), "
             "float32, 1 CPU thread:", f"  {'T':>6} {'FLOP-limit speedup':>19} {'measured speedup':>17}"]
    models = {}
    for attn in ("transformer", "orthros"):
        torch.manual_seed(0)
        models[attn] = Orthros(dataclasses.replace(cfg, attn=attn, max_seq_len=4096)).eval()
    for T in (1024, 2048, 4096):
        limit = answer.prefill_flops(dataclasses.replace(cfg, attn="transformer"), T) / \
            answer.prefill_flops(dataclasses.replace(cfg, attn="orthros"), T)
        idx = torch.randint(0, cfg.vocab_size, (1, T))
        seconds = {attn: median_seconds(lambda: m.prefill(idx)) for attn, m in models.items()}
        lines.append(f"  {T:>6} {limit:>18.2f}x {seconds['transformer'] / seconds['orthros']:>16.2f}x")
    lines.append("  The measured speedup is printed, never checked: it depends on the machine and its load.")
    return "\n".join(lines)
