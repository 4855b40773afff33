"""Exercise 7, prefill FLOPs: the checker. The references are perf/flops.py's own attended_pairs and forward_flops."""

import dataclasses
import timeit
from types import SimpleNamespace
from unittest import mock

import torch

from exercises.framework import Domain, difference
from orthros import Orthros, OrthrosConfig
from perf import flops

TITLE, DIFFICULTY, MINUTES = "Prefill FLOPs", 3, 35
FUNCTIONS = ("attended_pairs", "prefill_flops")
REFERENCE = SimpleNamespace(attended_pairs=flops.attended_pairs, prefill_flops=lambda cfg, T: flops.forward_flops(cfg, T, 1))
FORBIDDEN = dict.fromkeys((flops.forward_flops, flops.prefill_flop_limits, flops.train_flops),
                          "perf/flops.py's FLOP count, which the checker compares yours with: count them yourself")
PAPER = "the paper's (12 x 768, 6 heads, w=128, V=50304)"

SIZES = {"tiny (2 x 16, 2 heads, w=4, V=37)": OrthrosConfig(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4),
         "odd (3 x 48, 4 heads, w=7, V=101)": OrthrosConfig(vocab_size=101, n_layer=3, n_head=4, n_embd=48, window=7),
         "other (5 x 24, 1 head, w=5, V=38)": OrthrosConfig(vocab_size=38, n_layer=5, n_head=1, n_embd=24, window=5),
         "bench --tiny (2 x 128, 2 heads, w=16, V=4096)": OrthrosConfig(vocab_size=4096, n_layer=2, n_head=2, n_embd=128,
                                                                        window=16),
         PAPER: OrthrosConfig()}
windows = lambda T: [None, *sorted({w for w in (1, 2, T - 1, T, T + 1, 128) if w >= 1})]
DOMAIN = {"attended_pairs": Domain(pairs=True, T=[0, 1, 2, 3, 5, 8, 127, 128, 129, 300, 32768, 262144], window=windows,
                                   n_q=lambda T, window: [None, *sorted({0, 1, T // 2, T - 1, T} & set(range(T + 1)))]
                                   if window is None else [None, T]),
          "prefill_flops": Domain(lambda size, attn, **_: dict(cfg=dataclasses.replace(SIZES[size], attn=attn)), pairs=True,
                                  size=list(SIZES), attn=["transformer", "swa", "orthros"],
                                  T=[1, 3, 4, 5, 8, 100, 127, 128, 129, 300, 32768, 262144])}


def patched_forward_flops(answer, **options):
    """perf/flops.py's counts with your attended_pairs patched in"""
    for cfg in (dataclasses.replace(size, attn=attn) for size in SIZES.values() for attn in ("transformer", "swa", "orthros")):
        for T, t_out in ((7, 7), (300, 1), (300, 40)):
            right = flops.forward_flops(cfg, T, t_out)
            with mock.patch.multiple(flops, attended_pairs=answer.attended_pairs):
                problem = difference(flops.forward_flops(cfg, T, t_out), right, "the count")
            if problem:
                return f"flops.forward_flops(cfg, T={T}, t_out={t_out}), cfg: {cfg}: {problem}"


PROPERTIES = [patched_forward_flops]


def after_pass(answer, **options):
    """The FLOP limit of Orthros's prefill speedup (your count) next to a measured one on this CPU."""
    cfgs = {attn: dataclasses.replace(SIZES["bench --tiny (2 x 128, 2 heads, w=16, V=4096)"], attn=attn, max_seq_len=2048)
            for attn in ("transformer", "orthros")}
    models = {attn: Orthros(c).eval() for attn, c in cfgs.items()}
    lines = ["Prefill, Orthros against the Transformer, at perf/bench.py's --tiny size (2 layers, C=128, w=16), float32, 1 "
             "CPU thread, the fastest of 3 runs:", f"  {'T':>6} {'FLOP-limit speedup':>19} {'measured speedup':>17}"]
    for T in (1024, 2048):
        count = {attn: answer.prefill_flops(c, T) for attn, c in cfgs.items()}
        idx = torch.randint(0, 4096, (1, T))
        seconds = {attn: min(timeit.repeat(lambda: m.prefill(idx), number=1, repeat=3)) for attn, m in models.items()}
        lines.append(f"  {T:>6} {count['transformer'] / count['orthros']:>18.2f}x "
                     f"{seconds['transformer'] / seconds['orthros']:>16.2f}x")
    return "\n".join(lines + ["  The measured speedup is printed, never checked: it depends on the machine and its load."])
