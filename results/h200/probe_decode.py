"""
Scratch probe (one GPU call; python results/h200/probe_decode.py): which attention variant and which mode (eager + CUDA graph, or
compiled layers + CUDA graph) should engine.FastDecoder use? Bench model: 12 layers, d=768,
6 heads of 128, vocab 50304, bf16, random weights and a random cache (timing does not depend
on the values). Writes $OUT/probe_decode.json after every measurement.

Variants of decode_attention (engine.py's signature):
  mm      both twins in one pass over the bucket: q (B,H,2,D) @ K^T with float32 output, mask,
          softmax in float32, @ V (engine.py's choice before this probe)
  mm16    the same with bf16 scores (plain matmul; no float32-output bmm)
  sdpa    one SDPA call per twin: base twin over its gathered window, output twin over the
          bucket with a boolean mask (the prototype)
  hybrid  base twin: gathered window with plain matmul + softmax; output twin: SDPA as above
"""

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: engine.py, orthros.py

T_START = time.time()
BUDGET = float(os.environ.get("PROBE_BUDGET", "250"))  # seconds for this script, then stop starting work

import torch
import torch.nn.functional as F

import engine
import orthros
from engine import FastDecoder, attend, bucket_len
from orthros import Orthros, OrthrosConfig

OUT = os.environ.get("OUT", ".")
TINY = os.environ.get("PROBE_TINY") == "1"   # a CPU dry run of every line, tiny shapes
DEV = "cpu" if TINY else "cuda"
CFG = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, window=16) if TINY else {}
VOCAB = CFG.get("vocab_size", 50304)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
torch.set_float32_matmul_precision("high")
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096

MM = engine.decode_attention


def mm16(q, k_cache, v_cache, masks, window):
    if window is not None and q.size(2) == 1:
        rows, mask = window
        k, v = k_cache.index_select(2, rows), v_cache.index_select(2, rows)
    else:
        n = masks.size(1)
        k, v, mask = k_cache[:, :, :n], v_cache[:, :, :n], masks[:q.size(2)]
    scores = (q @ k.transpose(-1, -2)).float() * q.size(-1) ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def _per_twin(window_attend):
    def variant(q, k_cache, v_cache, masks, window):
        n, L = masks.size(1), q.size(2)
        full = lambda qq: orthros.sdpa(qq.contiguous(), k_cache[:, :, :n], v_cache[:, :, :n], masks[1:])
        if window is None:       # transformer: one full query
            return full(q)
        rows, mask = window
        y0 = window_attend(q[:, :, :1].contiguous(), k_cache.index_select(2, rows), v_cache.index_select(2, rows), mask)
        return y0 if L == 1 else torch.cat([y0, full(q[:, :, 1:])], dim=2)
    return variant


VARIANTS = {"mm": MM, "mm16": mm16, "sdpa": _per_twin(orthros.sdpa), "hybrid": _per_twin(attend)}
GATHER = {"mm": False, "mm16": False, "sdpa": True, "hybrid": True}  # orthros reads its window by rows

results = {"meta": {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "env": {k: os.environ.get(k) for k in ("PROBE_BUDGET", "PROBE_TINY")},
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "bmm_schema": str(torch.ops.aten.bmm.dtype._schema) if hasattr(torch.ops.aten.bmm, "dtype") else None,
                    "command": " ".join(sys.argv)},
           "checks": [], "timing": [], "notes": []}


def save():
    path = os.path.join(OUT, "probe_decode.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def left():
    return BUDGET - (time.time() - T_START)


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def build(attn, dtype=torch.bfloat16, max_seq_len=140000):
    torch.manual_seed(0)
    with torch.device(DEV):  # blocked SWA: the checks' prefills need no FlexAttention compile
        model = Orthros(OrthrosConfig(attn=attn, max_seq_len=max_seq_len, swa_impl="blocked", **CFG))
    with torch.no_grad():  # move the scale-offsets off identity, as training would
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("alpha", "beta", "alpha_out", "beta_out"):
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def make_decoder(model, variant, B, max_len, compile):
    """compile: False (eager step), "layer" (FastDecoder(compile=True): each layer compiled) or
    "step" (the whole step compiled as one graph)."""
    engine.decode_attention = VARIANTS[variant]
    dec = FastDecoder(model, B, max_len=max_len, compile=compile == "layer")
    if compile == "step":
        dec._step = torch.compile(dec._step, fullgraph=True, dynamic=True)
    dec.gather_window = model.config.attn == "swa" or (GATHER[variant] and model.config.attn == "orthros")
    return dec


# -----------------------------------------------------------------------------
# 1. Correctness: teacher-forced logits vs the naive decoder (bf16) and vs float32 naive.

def check(attn, variants):
    """Teacher-forced logits of 24 decode steps after a 1000-token prompt, batch 2: each
    variant's fast decoder (eager + graph) against the naive decoder in bf16 and in float32."""
    B, T, steps = 2, 1000 if not TINY else 100, 24
    gen = torch.Generator(device=DEV).manual_seed(1)
    idx = torch.randint(0, VOCAB, (B, T + steps), device=DEV, generator=gen)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()

    def run(dec):
        with torch.inference_mode():
            logits, st = dec.prefill(idx[:, :T])
            seq = []
            for t in range(T, T + steps):
                logits, st = dec.decode(idx[:, t:t + 1], st)
                seq.append(logits.float())
        return torch.cat(seq, 1)
    try:
        ref32 = run(build(attn, torch.float32, 2048))
        m16 = build(attn, max_seq_len=2048)
        naive = run(m16)
    except Exception as e:
        traceback.print_exc()
        results["checks"].append({"attn": attn, "error": f"{type(e).__name__}: {e}"[:400]})
        return
    for variant in variants:
        rec = {"variant": variant, "attn": attn, "naive_vs_fp32": rel(naive, ref32)}
        try:
            fast = run(make_decoder(m16, variant, B, T + steps + 8, False))
            rec.update(fast_vs_naive=rel(fast, naive), fast_vs_fp32=rel(fast, ref32),
                       argmax_agree_naive=(fast.argmax(-1) == naive.argmax(-1)).float().mean().item())
        except Exception as e:
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
        results["checks"].append(rec)
        log("check", rec)
        save()


# -----------------------------------------------------------------------------
# 2. Timing: tokens/s of FastDecoder.decode (greedy loop as in bench.py) over a random cache.

def time_one(model, variant, ctx, B, compile, steps=100, warm=4):
    max_len = bucket_len(ctx + steps + warm + 2)
    dec = make_decoder(model, variant, B, max_len, compile)
    with torch.no_grad():
        for t in dec.cache.k + dec.cache.v:
            t.normal_()
    dec.cache.length = ctx
    tok = torch.randint(0, VOCAB, (B, 1), device=DEV)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, st = dec.decode(tok, dec.cache)  # capture (and compile)
        sync()
        first_s = time.perf_counter() - t0
        for _ in range(warm):
            logits, st = dec.decode(logits[:, -1].argmax(-1, keepdim=True), st)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, st = dec.decode(logits[:, -1].argmax(-1, keepdim=True), st)
        sync()
        dt = time.perf_counter() - t0
    n_graphs = len(dec.graphs)
    del dec, st, logits
    return {"tokens_per_s": B * steps / dt, "ms_per_step": 1e3 * dt / steps, "first_call_s": first_s,
            "graphs": n_graphs, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if DEV == "cuda" else None}


def hbm_fraction(model, ctx_mean, B, ms):
    """(weight bytes + valid KV bytes read per step) / time / 4.8 TB/s."""
    cfg = model.config
    w = sum(p.numel() for p in model.parameters()) * 2
    keys = ctx_mean if cfg.attn != "swa" else min(ctx_mean, cfg.window)
    kv = cfg.n_layer * 2 * B * keys * cfg.n_embd * 2
    return (w + kv) / (ms / 1e3) / 4.8e12


def timing(models, variants, shapes, compile, reps=2, min_left=20):
    for ctx, B in shapes:
        for variant in variants:
            for rep in range(reps):
                for attn, model in models.items():
                    if left() < min_left:
                        results["notes"].append(f"stopped before {variant} {attn} ctx={ctx} B={B} compile={compile}: budget")
                        save()
                        return False
                    rec = {"variant": variant, "attn": attn, "ctx": ctx, "batch": B, "compile": compile, "rep": rep}
                    if DEV == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        rec.update(time_one(model, variant, ctx, B, compile))
                        rec["hbm_fraction"] = hbm_fraction(model, ctx + 52, B, rec["ms_per_step"])
                    except Exception as e:
                        traceback.print_exc()
                        rec["error"] = f"{type(e).__name__}: {e}"[:400]
                    results["timing"].append(rec)
                    log("time", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()})
                    save()
    return True


def summary():
    results["summary"], rows = [], {}
    for r in results["timing"]:
        if "tokens_per_s" in r:
            rows.setdefault((r["variant"], r["compile"], r["ctx"], r["batch"], r["attn"]), []).append(r["tokens_per_s"])
    print("\nvariant  compile   ctx  B | transformer   orthros  ratio | swa")
    keys = sorted({k[:4] for k in rows}, key=lambda k: (str(k[1]), k[0], k[2], k[3]))
    for k in keys:
        t = statistics.median(rows.get(k + ("transformer",), [float("nan")]))
        o = statistics.median(rows.get(k + ("orthros",), [float("nan")]))
        s = statistics.median(rows.get(k + ("swa",), [float("nan")]))
        print(f"{k[0]:>7} {str(k[1]):>7} {k[2]:>6} {k[3]:>2} | {t:11.0f} {o:9.0f} {o / t:6.3f} | {s:6.0f}")
        results.setdefault("summary", []).append({"variant": k[0], "compile": k[1], "ctx": k[2], "batch": k[3],
                                                  "transformer": t, "orthros": o, "swa": s, "ratio": o / t})
    save()


def main():
    log(results["meta"])
    try:  # float32 scores from bf16 operands (engine._scores); fall back to bf16 scores if absent
        a = torch.randn(2, 2, 8, device=DEV, dtype=torch.bfloat16)
        torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32) if DEV == "cuda" else None
        results["meta"]["bmm_out_dtype"] = DEV == "cuda"
    except Exception as e:
        results["meta"]["bmm_out_dtype"] = f"{type(e).__name__}: {e}"[:300]
        engine._scores = lambda q, k: (q @ k.transpose(-1, -2)).float()
        VARIANTS["mm"] = engine.decode_attention
        log("NOTE: no float32-output bmm; mm falls back to bf16 scores", e)
    check("orthros", list(VARIANTS))
    check("transformer", ["mm", "mm16", "sdpa"])
    check("swa", ["mm"])
    if DEV == "cuda":
        torch.cuda.empty_cache()
    models = {a: build(a) for a in ("transformer", "orthros")}
    key_shapes = [(4096, 1), (32768, 1), (32768, 8), (131072, 8)]
    more_shapes = [(4096, 8), (131072, 1)]
    if TINY:
        key_shapes, more_shapes = [(64, 1), (300, 2)], [(64, 2)]
    # eager + graph: all variants at the key shapes, then the rest
    timing(models, ["mm", "sdpa", "hybrid"], key_shapes, compile=False)  # mm16: precision check only
    timing(models, ["mm", "sdpa", "hybrid"], more_shapes, compile=False, reps=1)
    summary()
    # compiled + graph: the most promising first
    plan = (("mm", "layer", 60), ("mm", "step", 80), ("hybrid", "layer", 60), ("sdpa", "layer", 60))
    if TINY:
        plan = (("mm", "step", 80),)
    for v, mode, need in plan:
        if left() < need:
            results["notes"].append(f"compiled {v} ({mode}): skipped, budget")
            continue
        timing(models, [v], key_shapes, compile=mode, min_left=need // 2, reps=2 if mode == "layer" else 1)
    timing({"swa": build("swa")}, ["mm"], key_shapes, compile=False, reps=1, min_left=10)
    summary()
    log("done")


if __name__ == "__main__":
    main()
