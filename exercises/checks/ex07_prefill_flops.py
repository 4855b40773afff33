"""Exercise 7, prefill FLOPs: the checker, hints and known bugs."""

import dataclasses
import statistics
import time
from types import SimpleNamespace

import torch

import bench
from exercises.framework import Bug, Case, patched, variant
from exercises.solutions import ex07_prefill_flops as solution
from orthros import Orthros, OrthrosConfig

TITLE = "Prefill FLOPs"
DIFFICULTY = 3
MINUTES = 35
TEACHES = "why prefill is linear: T(T+1)/2 pairs against ~Tw + T; the FLOP-limit speedup against a measured one"
FUNCTIONS = ("attended_pairs", "prefill_flops")
REFERENCE = SimpleNamespace(attended_pairs=bench.attended_pairs, prefill_flops=solution.prefill_flops)

HINTS = [
    "Count pairs row by row. Without a window, the query at position t sees t + 1 keys; the last n_q "
    "queries are t = T-n_q ... T-1. With a window, the first w queries see 1, 2, ..., w keys and every "
    "later one exactly w (careful when w > T). Then FLOPs: every token in a layer pays the token-wise "
    "matrices; Orthros's prefill has T base tokens and ONE output token, which has a query but no key.",
    "attended_pairs: no window: n_q * T - n_q * (n_q - 1) // 2;  window: w = min(window, T); "
    "w * (w + 1) // 2 + (T - w) * window\n"
    "prefill_flops: n_tokens = T + 1 (orthros) or T;  tokenwise = 2 * (10 C^2 n_tokens + 2 C^2 T)\n"
    "pairs = T(T+1)/2 (transformer), or the window's pairs (+ T for Orthros's one output query)\n"
    "total = n_layer * (tokenwise + 4 C pairs) + 2 C V",
    "Paper, section 3.3 (Complexity Analysis): sliding window attention O(TWd), full cross-attention "
    "O(T_out T d), token-wise projections O((T + T_out) d^2); prefilling has T_out = 1. In the repo: "
    "bench.py, forward_flops and prefill_flop_limits.",
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


def cases(**options):
    found = []
    for T in (1, 2, 3, 4, 5, 8, 100):
        calls = [(T, None, None)] + [(T, w, None) for w in (1, 2, 3, 8)] + \
                [(T, None, n_q) for n_q in sorted({1, 2, T // 2, T} & set(range(1, T + 1)))]
        for args in calls:
            found.append(Case(
                f"attended_pairs(T={args[0]}, window={args[1]}, n_q={args[2]})",
                lambda impl, args=args: impl.attended_pairs(*args),
                "query t sees t + 1 keys without a window and min(t + 1, w) with one; the sum over the last "
                "n_q queries (bench.attended_pairs)"))
    for name, cfg in SIZES.items():
        for attn in ("transformer", "swa", "orthros"):
            for T, t_out in ((7, 7), (300, 1), (300, 40)):
                c = dataclasses.replace(cfg, attn=attn)
                found.append(Case(
                    f"bench.forward_flops(cfg, T={T}, t_out={t_out}), {attn}, {name}, with your attended_pairs "
                    "patched into bench.py",
                    lambda impl, c=c, T=T, t_out=t_out: patched_forward_flops(impl, c, T, t_out),
                    "bench.py's FLOP counts (prefill, SFT, pre-training) are unchanged with your attended_pairs"))
    for name, cfg in SIZES.items():
        for T in (1, 3, 4, 5, 100, 128, 129, 32768, 262144):
            for attn in ("transformer", "swa", "orthros"):
                c = dataclasses.replace(cfg, attn=attn)
                found.append(Case(
                    f"prefill_flops(cfg, T={T}), {attn}, {name}",
                    lambda impl, c=c, T=T: impl.prefill_flops(c, T),
                    "exactly bench.forward_flops(cfg, T, 1): token-wise matrices on every token (Orthros: T + 1), "
                    "W_K, W_V on the T base tokens, 4C per attended pair, the LM head at one position",
                    expected=lambda c=c, T=T: bench.forward_flops(c, T, 1)))
    return found


def patched_forward_flops(impl, cfg, T, t_out):
    with patched(bench, attended_pairs=impl.attended_pairs):
        return bench.forward_flops(cfg, T, t_out)


def median_seconds(fn, reps=3):
    fn()  # warm-up: allocator, first-call setup
    return statistics.median(timed(fn) for _ in range(reps))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def after_pass(impl, **options):
    """The FLOP limit of Orthros's prefill speedup (your count) next to a measured one on this CPU."""
    cfg = SIZES["bench --tiny (2 x 128, w=16, V=4096)"]
    lines = ["Prefill, Orthros against the Transformer, at bench.py's --tiny size (2 layers, C=128, w=16), "
             "float32, 1 CPU thread:", f"  {'T':>6} {'FLOP-limit speedup':>19} {'measured speedup':>17}"]
    models = {}
    for attn in ("transformer", "orthros"):
        torch.manual_seed(0)
        models[attn] = Orthros(dataclasses.replace(cfg, attn=attn, max_seq_len=4096)).eval()
    for T in (1024, 2048, 4096):
        limit = impl.prefill_flops(dataclasses.replace(cfg, attn="transformer"), T) / \
            impl.prefill_flops(dataclasses.replace(cfg, attn="orthros"), T)
        idx = torch.randint(0, cfg.vocab_size, (1, T))
        seconds = {attn: median_seconds(lambda: m.prefill(idx)) for attn, m in models.items()}
        lines.append(f"  {T:>6} {limit:>18.2f}x {seconds['transformer'] / seconds['orthros']:>16.2f}x")
    lines.append("  The measured speedup is printed, never checked: it depends on the machine and its load.")
    return "\n".join(lines)
