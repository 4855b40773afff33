"""Exercise 7, prefill FLOPs: the checker. The references: perf/flops.py's own counts."""

import dataclasses
import timeit
from types import SimpleNamespace
from unittest import mock

import torch

from exercises.framework import Domain, difference, within
from orthros import Orthros, OrthrosConfig
from perf import flops

TITLE, DIFFICULTY, MINUTES = "Prefill FLOPs", 3, 35
FUNCTIONS = ("attended_pairs", "prefill_flops")
REFERENCE = SimpleNamespace(attended_pairs=flops.attended_pairs,
                            prefill_flops=lambda cfg, T: flops.forward_flops(cfg, T, 1))
FORBIDDEN = dict.fromkeys((flops.forward_flops, flops.prefill_flop_limits, flops.train_flops),
                          "perf/flops.py's FLOP count, which the checker compares yours with")
PAPER = "size=\"the paper's (12 x 768, 6 heads, w=128, V=50304)\""
ATTNS = ("transformer", "swa", "orthros")
SIZES = {f"{name} ({L} x {C}, {H} heads, w={w}, V={V})": dict(
    n_layer=L, n_embd=C, n_head=H, window=w, vocab_size=V) for name, L, C, H, w, V in [
    ("tiny", 2, 16, 2, 4, 37), ("odd", 3, 48, 4, 7, 101), ("other", 5, 24, 1, 5, 38),
    ("bench --tiny", 2, 128, 2, 16, 4096), ("the paper's", 12, 768, 6, 128, 50304)]}
BENCH = "bench --tiny (2 x 128, 2 heads, w=16, V=4096)"
DOMAIN = {"attended_pairs": Domain(
    pairs=True, T=[0, 1, 2, 3, 5, 8, 127, 128, 129, 300, 32768, 262144],
    window=lambda T: [None, *within(1, T + 129, 1, 2, T - 1, T, T + 1, 128)],
    n_q=lambda T, window: [None, T] if window else [None, *within(0, T, 0, 1, T // 2, T - 1, T)]),
    "prefill_flops": Domain(
    lambda size, attn, **_: dict(cfg=OrthrosConfig(**SIZES[size], attn=attn)), pairs=True,
    size=list(SIZES), attn=list(ATTNS), T=[1, 3, 4, 5, 8, 100, 127, 128, 129, 300, 32768, 262144])}


def patched_forward_flops(answer, **options):
    """perf/flops.py's counts with your attended_pairs patched in"""
    for cfg in (OrthrosConfig(**size, attn=attn) for size in SIZES.values() for attn in ATTNS):
        for T, t_out in ((7, 7), (300, 1), (300, 40)):
            right = flops.forward_flops(cfg, T, t_out)
            with mock.patch.multiple(flops, attended_pairs=answer.attended_pairs):
                problem = difference(flops.forward_flops(cfg, T, t_out), right, "the count")
            if problem:
                return f"flops.forward_flops(cfg, T={T}, t_out={t_out}), cfg: {cfg}: {problem}"


PROPERTIES = [patched_forward_flops]


def after_pass(answer, **options):
    """The FLOP limit of Orthros's prefill speedup (your count) beside one measured here."""
    cfgs = {attn: OrthrosConfig(**SIZES[BENCH], attn=attn) for attn in ("transformer", "orthros")}
    models = {attn: Orthros(cfg).eval() for attn, cfg in cfgs.items()}
    lines = ["Prefill, Orthros against the Transformer, at perf/bench.py's --tiny size (2 layers, "
             "C=128, w=16), float32, 1 CPU thread, the fastest of 3 runs:",
             f"  {'T':>6} {'FLOP-limit speedup':>19} {'measured speedup':>17}"]
    for T in (1024, 2048):
        count = {attn: answer.prefill_flops(cfg, T) for attn, cfg in cfgs.items()}
        idx = torch.randint(0, 4096, (1, T))
        seconds = {attn: min(timeit.repeat(lambda: m.prefill(idx), number=1, repeat=3))
                   for attn, m in models.items()}
        lines.append(f"  {T:>6} {count['transformer'] / count['orthros']:>18.2f}x "
                     f"{seconds['transformer'] / seconds['orthros']:>16.2f}x")
    return "\n".join(lines + ["  The measured speedup is printed, never checked: it varies."])
