"""
Orthros against the Transformer and SWA at one size (12 layers, d=768, 6 heads, w=128, vocabulary
50304, bf16, random weights and tokens), in one process. --sections:
  prefill  model.prefill's latency at each --prefill_lens (batch 1), the speedup over the
           Transformer and its FLOP-count limit (perf/flops.py)
  decode   tokens/s of the naive KV cache (model.decode) and engine.FastDecoder (+compile: its step
           compiled) through the model's decode loop, as sample.py runs it, after a prompt cache of
           each --decode_ctx at each --decode_batches; --decode_reps interleaved rounds, median; the
           fraction of the HBM-bandwidth limit, the graphs compiled during the timed steps
  train    forward + backward + AdamW step at --train_T: ms, tokens/s and MFU
Every figure records the peak GPU memory; the JSON (--out) is rewritten after each measurement.

    python perf/bench.py --compile                 # every section on a GPU
    python perf/bench.py --tiny --device cpu       # a smoke run of every line, < 1 minute
    python perf/bench.py --sections decode --decode_ctx 131072,32768,4096 --decode_cache random \\
        --decode_steps 40 --decode_variants naive,fast+compile --time_budget 140

On one H200 a section fits a 10-minute call (prefill with --compile ~5 min, train ~1 min; the
decode matrix with --time_budget), all three do not.
"""

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # python perf/bench.py: repo imports
from checkpoint import ArgumentParser, pick_device, run_meta, sync
from data.prepare_utils import atomic_write
from orthros import KVCache, Orthros, OrthrosConfig, compile_blocks
from perf.engine import FastDecoder
from perf.flops import peak_flops, prefill_flop_limits, train_flops

MODELS = ("transformer", "orthros", "swa")  # the Transformer first: the others' speedups need it
VARIANTS = ("naive", "fast", "fast+compile")
TINY = dict(n_layer=2, n_embd=128, n_head=2, window=16, vocab_size=4096, long_T=512, reps=3,
            prefill_lens="256,512,1024", decode_ctx="64,128", decode_batches="1,2",
            decode_steps=8, decode_variants="naive,fast", train_T=256, train_batch=2)


def decode_bytes(cfg, n_params, batch, keys, dtype_bytes=2):
    """The fewest bytes one decode step reads: every weight once (the tied embedding once), and the
    K and V of the keys the new token attends: the valid prefix `keys` for the Transformer and
    Orthros (the base twin's window lies inside the prefix the output twin reads), min(keys,
    window) for SWA. Rows read past the prefix, the naive cache's copies: overhead, not work."""
    keys_read = min(keys, cfg.window) if cfg.attn == "swa" else keys
    kv_width = (cfg.head_dim or cfg.n_embd // cfg.n_head) * (cfg.n_kv_head or cfg.n_head)
    return n_params * dtype_bytes + cfg.n_layer * 2 * batch * keys_read * kv_width * dtype_bytes


def time_fn(fn, device, reps, warmup):
    """Median seconds of fn() over reps calls after warmup calls, synchronized: the GPU's time."""
    times = []
    for _ in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device):
    """fn() -> {figures}, "status" ("ok", "OOM", the error: not raised) and the peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        rec = {**fn(), "status": "ok"}
    except Exception as e:  # NOTE: the tensors the traceback holds are freed when this block ends
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        if not oom:
            traceback.print_exc()
        rec = {"status": "OOM" if oom else f"error: {type(e).__name__}: {e}"[:300]}
    gc.collect()  # a compiled decoder's cache is held in cycles that Dynamo's tracing leaves
    if device.type == "cuda" and rec["status"] == "ok":
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return rec


def model_config(args, attn):
    return OrthrosConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd, window=args.window, attn=attn,
                         max_seq_len=args.max_seq_len)


def build_model(args, attn, dtype, device, compile=False):
    """The model for attn, the same weights every call (compile: its blocks, once warmed up)."""
    torch.manual_seed(0)
    with torch.device(device):  # initialized on the device: much faster
        model = Orthros(model_config(args, attn)).to(dtype)
    return compile_blocks(model) if compile else model


# -- Prefill ---------------------------------------------------------------------------------

def bench_prefill(args, device, results, save):
    for attn in args.models:
        model, oom = build_model(args, attn, args.dtype, device, args.compile).eval(), False
        for T in args.prefill_lens:
            rec = {"attn": attn, "T": T, "batch": 1}
            # Past long_T the kernels are warm from the shorter T, and one prefill may take minutes.
            long = T > args.long_T
            reps, warmup = (args.long_reps, args.long_warmup) if long else (args.reps, args.warmup)
            if oom:  # a longer prompt cannot fit either
                rec["status"] = "OOM (skipped: a shorter T ran out of memory)"
            else:
                idx = torch.randint(0, args.vocab_size, (1, T), device=device)
                run = lambda: model.prefill(idx)
                with torch.inference_mode():
                    rec.update(measure(lambda: {"ms": 1e3 * time_fn(run, device, reps, warmup),
                                                "reps": reps, "warmup": warmup}, device))
                oom, idx = rec["status"] == "OOM", None
                free_memory(device)
            results["prefill"].append(rec)
            print(f"prefill {attn} T={T}: {fmt(rec, 'ms', '{:.2f} ms')}", flush=True)
            save()
        model = None  # free it before the next model
        free_memory(device)
    ms = {(r["attn"], r["T"]): r.get("ms") for r in results["prefill"]}
    for T in args.prefill_lens:  # speedups over the Transformer, beside their FLOP-count limits
        rec = {"T": T}
        for attn in ("orthros", "swa"):
            ref, mine = ms.get(("transformer", T)), ms.get((attn, T))
            rec[f"{attn}_speedup"] = ref / mine if ref and mine else None
            rec[f"{attn}_flop_limit"], rec[f"{attn}_flop_limit_lm_head_all_tokens"] = \
                prefill_flop_limits(model_config(args, "orthros"), T, attn)
        results["prefill_speedup"].append(rec)
    save()


def table_prefill(results):
    recs = {(r["attn"], r["T"]): r for r in results["prefill"]}
    rows = [[s["T"], *(fmt(recs.get((a, s["T"]), {}), "ms", "{:.2f}") + " ("
                       + fmt(recs.get((a, s["T"]), {}), "peak_mem_gb", "{:.1f}") + ")"
                       for a in MODELS),
             *(fmt(s, f"{a}_speedup", "{:.2f}x") + f" [{s[f'{a}_flop_limit']:.1f}; "
               f"{s[f'{a}_flop_limit_lm_head_all_tokens']:.1f}]" for a in ("orthros", "swa"))]
            for s in results["prefill_speedup"]]
    print_table("Prefill latency, batch 1: ms (peak GB incl. weights); speedup over the Transformer"
                " [FLOP limit; limit with the LM head on every token]",
                ["T", *MODELS, "orthros x [limit; all]", "swa x [limit; all]"], rows)


# -- Decode ----------------------------------------------------------------------------------

def prompt_cache(args, model, ctx, B, device):
    """(logits (B, 1, vocab), KVCache of ctx positions): model.prefill's of a random prompt, or
    random keys, values and logits (--decode_cache random: values do not change a step's time)."""
    with torch.inference_mode():
        if args.decode_cache == "prefill":
            return model.prefill(torch.randint(0, args.vocab_size, (B, ctx), device=device))
        cfg, cache = model.config, KVCache(model, B)
        randn = lambda *shape: torch.randn(shape, device=device, dtype=args.dtype)
        for layer in cache.layers:
            layer.k, layer.v = (randn(B, cfg.n_head, ctx, cfg.n_embd // cfg.n_head) for _ in "kv")
        cache.length = ctx
        return randn(B, 1, cfg.vocab_size), cache


def time_steps(args, B, device, tokens):
    """The generator `tokens` (a token after the prompt, then one a step): args.decode_steps steps
    timed after args.warmup untimed ones (graph capture, any compiling)."""
    unique_graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiled
    graphs, t_first = unique_graphs(), time.perf_counter()
    for step, _ in enumerate(tokens):
        if step == 0 and device.type == "cuda":  # the decode phase's peak: the cache and a step
            torch.cuda.reset_peak_memory_stats(device)
        if step == args.warmup:
            sync(device)
            t0, graphs_warm = time.perf_counter(), unique_graphs()
    sync(device)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": B * args.decode_steps / dt, "ms_per_step": 1e3 * dt / args.decode_steps,
            "warmup_s": t0 - t_first, "compiles_warmup": graphs_warm - graphs,
            "compiles_timed": unique_graphs() - graphs_warm}


def decode_run(args, model, variant, prompt, B, device):
    """Greedy decode steps after the prompt's cache: model.generate_tokens (naive), or that of
    FastDecoder(model, B, max_len=the context + new tokens, compile=...) (fast)."""
    logits, cache = prompt
    n_tokens = args.warmup + args.decode_steps + 1
    idx = torch.zeros(1, 1, dtype=torch.long, device=device).expand(B, cache.length)  # unread
    with torch.inference_mode():
        if variant == "naive":  # from a copy: the naive cache grows by new tensors, per layer
            state = copy.copy(cache)
            state.layers = [copy.copy(layer) for layer in cache.layers]
            decoder = SimpleNamespace(prefill=lambda idx: (logits, state), decode=model.decode)
            tokens = model.generate_tokens(idx, n_tokens, temperature=0, decoder=decoder)
        else:
            fast = FastDecoder(model, B, max_len=cache.length + n_tokens,
                               compile=variant == "fast+compile")
            tokens = fast.generate_tokens(idx, n_tokens, temperature=0, prompt=(logits, cache))
        rec = time_steps(args, B, device, tokens)
        if args.profile and variant != "naive" and device.type == "cuda":
            try:
                rec["kernels"] = profile_steps(fast, 20, device)
            except Exception as e:   # the timing above stands
                rec["kernels"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return rec


def profile_steps(fast, n_steps, device):
    """A warm decoder's GPU kernels over n_steps steps (its CUDA graph replayed), torch.profiler:
    per step, microseconds and launches of each kernel, FlexAttention's ("flex") apart."""
    from torch.profiler import ProfilerActivity, profile
    fast.pos.sub_(n_steps)   # stay inside the cache: the steps rewrite rows already decoded
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            fast._run(0, None)
        sync(device)
    kernels = {e.key: (e.device_time_total / n_steps, e.count / n_steps)
               for e in prof.key_averages() if e.device_time_total > 0}
    return {"us_per_step": sum(us for us, _ in kernels.values()),
            "launches_per_step": sum(n for _, n in kernels.values()),
            "flex_us_per_step": sum(us for k, (us, _) in kernels.items() if "flex" in k.lower()),
            "top": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]}


def gptfast_tokens(args, ctx, B, device):
    """gpt-fast's decode loop (greedy) at the bench's shape, its model.py from --gptfast DIR: a
    static cache of random keys and values, the step compiled as gpt-fast does (reduce-overhead,
    coordinate-descent tuning, math SDPA). Its SwiGLU of width 8C/3 has 8C^2 weights, as GELU's."""
    sys.path.insert(0, args.gptfast)
    from model import ModelArgs, Transformer   # gpt-fast's
    rows = ctx + args.warmup + args.decode_steps + 1
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelArgs(block_size=rows, vocab_size=args.vocab_size, dim=args.n_embd,
                                      n_layer=args.n_layer, n_head=args.n_head,
                                      intermediate_size=8 * args.n_embd // 3))
        model.setup_caches(B, rows)
    model = model.to(args.dtype).eval()
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.normal_()
        layer.attention.kv_cache.v_cache.normal_()
    step = torch.compile(lambda x, pos: model(x, pos)[:, -1].argmax(-1, keepdim=True),
                         mode="reduce-overhead", fullgraph=True)
    token = torch.zeros(B, 1, dtype=torch.long, device=device)
    pos = torch.tensor([ctx], device=device)
    with torch._inductor.config.patch(coordinate_descent_tuning=True), torch.inference_mode(), \
            sdpa_kernel(SDPBackend.MATH):
        yield token
        for _ in range(rows - ctx - 1):
            token = step(token, pos).clone()
            pos += 1
            yield token


def bench_decode(args, device, results, save):
    """Rounds of every (ctx, batch): per model one prompt cache, every variant from it in turn
    (interleaved: a slow spell hits all alike). The first round runs whole; --time_budget skips a
    later round of a setting that would not fit (by its fastest round so far)."""
    models = {attn: build_model(args, attn, args.dtype, device).eval() for attn in args.models}
    runs, round_s = {}, {}  # (ctx, B, attn, variant) -> [record per round]; (ctx, B) -> seconds
    meta = results["decode_meta"] = {"decode_cache": args.decode_cache, "skipped": [],
                                     "time_budget_s": args.time_budget}
    for rnd in range(args.decode_reps):
        for ctx, B in [(ctx, B) for ctx in args.decode_ctx for B in args.decode_batches]:
            t0, line = time.time(), []
            if rnd and args.time_budget and t0 - args.t_start + round_s[ctx, B] > args.time_budget:
                meta["skipped"].append({"ctx": ctx, "batch": B, "round": rnd + 1})
                print(f"NOTE: decode ctx={ctx} B={B} round {rnd + 1} skipped: --time_budget "
                      f"{args.time_budget} s ({t0 - args.t_start:.0f} s spent)", flush=True)
                continue
            free_memory(device)
            for attn, model in models.items():
                try:
                    prompt = prompt_cache(args, model, ctx, B, device)
                except Exception as e:  # e.g. OOM: every variant of this model fails alike
                    prompt = f"prompt cache failed: {type(e).__name__}: {e}"[:300]
                for v in args.decode_variants:
                    rec = {"status": prompt} if isinstance(prompt, str) else \
                        measure(lambda: decode_run(args, model, v, prompt, B, device), device)
                    runs.setdefault((ctx, B, attn, v), []).append(rec)
                    line.append(f"{attn} {v}: {fmt(rec, 'tokens_per_s', '{:.0f}')}")
                prompt = None
            if args.gptfast:
                gptfast = lambda: time_steps(args, B, device, gptfast_tokens(args, ctx, B, device))
                rec = measure(gptfast, device)
                runs.setdefault((ctx, B, "transformer", "gpt-fast"), []).append(rec)
                line.append(f"gpt-fast: {fmt(rec, 'tokens_per_s', '{:.0f}')}")
            round_s[ctx, B] = min(round_s.get((ctx, B), float("inf")), time.time() - t0)
            print(f"decode round {rnd + 1} ctx={ctx} B={B} ({time.time() - t0:.1f} s), tok/s: "
                  + "; ".join(line), flush=True)
            results["decode"] = [summarize(args, models, key, recs) for key, recs in runs.items()]
            save()
        if args.out_decode_png and results["decode"]:  # a run cut short still leaves a plot
            plot_decode(results, args.out_decode_png)
    models = None
    free_memory(device)


def summarize(args, models, key, recs):
    """One setting's rounds: the medians of those that ran (else the first failure), and the
    fraction of the HBM-bandwidth limit, by decode_bytes."""
    ctx, B, attn, variant = key
    ok = [r for r in recs if r["status"] == "ok"]
    rec = {"attn": attn, "variant": variant, "ctx": ctx, "batch": B, "steps": args.decode_steps,
           "runs": len(recs), "status": "ok" if ok else recs[0]["status"]}
    if not ok:
        return rec
    median = lambda key: statistics.median(r[key] for r in ok)
    rec.update(tokens_per_s=median("tokens_per_s"), ms_per_step=median("ms_per_step"),
               runs_tokens_per_s=[r["tokens_per_s"] for r in ok],
               warmup_s=[round(r["warmup_s"], 3) for r in ok],
               compiles_warmup=sum(r["compiles_warmup"] for r in ok),
               compiles_timed=sum(r["compiles_timed"] for r in ok), kernels=ok[-1].get("kernels"),
               peak_mem_gb=max((r["peak_mem_gb"] for r in ok if "peak_mem_gb" in r), default=None),
               failed_runs=[r["status"] for r in recs if r["status"] != "ok"] or None)
    if attn in models:
        cfg, n_params = models[attn].config, sum(p.numel() for p in models[attn].parameters())
        keys = ctx + args.warmup + (args.decode_steps + 1) / 2  # the timed steps' mean prefix
        step_bytes = decode_bytes(cfg, n_params, B, keys, torch.finfo(args.dtype).bits // 8)
        rec["hbm_fraction"] = step_bytes / (rec["ms_per_step"] / 1e3) / (args.hbm_tbps * 1e12)
    return {k: v for k, v in rec.items() if v is not None}


def table_decode(results):
    recs = {(r["attn"], r["variant"], r["ctx"], r["batch"]): r for r in results["decode"]}
    cell = lambda r: "" if not r else (fmt(r, "tokens_per_s", "{:.0f}") + fmt(
        r, "hbm_fraction", " [{:.0%}]") + fmt(r, "ms_per_step", " {:.2f}"))
    rows = []
    for ctx, B, v in dict.fromkeys((r["ctx"], r["batch"], r["variant"]) for r in results["decode"]):
        models = [recs.get((a, v, ctx, B), {}) for a in MODELS]
        t, o = (r.get("tokens_per_s") for r in models[:2])  # the Transformer's, Orthros's
        rows.append([ctx, B, v, *map(cell, models), f"{o / t:.2f}" if t and o else "-",
                     " ".join(fmt(r, "peak_mem_gb", "{:.1f}") for r in models if r)])
    print_table("Decode: tokens/s (median of the interleaved rounds) [fraction of the HBM-bandwidth"
                " limit] ms/step; naive = model.decode with the KVCache, fast = engine.FastDecoder,"
                " +compile = its step compiled",
                ["ctx", "batch", "variant", *MODELS, "orthros/transformer", "peak GB"],
                sorted(rows, key=lambda row: row[:2]))
    for r in results["decode"]:
        if (k := r.get("kernels", {})).get("us_per_step"):
            print(f"profile {r['attn']} {r['variant']} ctx={r['ctx']} B={r['batch']}: "
                  f"{k['launches_per_step']:.0f} kernels, {k['us_per_step']:.0f} us a step, of "
                  f"which FlexAttention's {k['flex_us_per_step']:.0f} us")
    timed = [f"{r['attn']} {r['variant']} ctx={r['ctx']} B={r['batch']}: {r['compiles_timed']}"
             for r in results["decode"] if r.get("compiles_timed")]
    print("compiled graphs during timed steps: " + ("; ".join(timed) if timed else "none"))


# -- Train -----------------------------------------------------------------------------------

def bench_train(args, device, results, save):
    T, B, peak = args.train_T, args.train_batch, peak_flops(device)
    for attn in args.models:
        def run():
            model = build_model(args, attn, torch.float32, device, args.compile).train()  # fp32
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            idx = torch.randint(0, args.vocab_size, (B, T + 1), device=device)

            def step():
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            sec = time_fn(step, device, args.reps, args.warmup + 1)
            flops = train_flops(model.config, T, B)
            return {"ms": 1e3 * sec, "tokens_per_s": B * T / sec, "flops_per_step": flops,
                    "mfu": flops / sec / peak if peak else None, "compiled": args.compile}

        results["train"].append(rec := {"attn": attn, "T": T, "batch": B, **measure(run, device)})
        free_memory(device)
        print(f"train {attn} T={T} B={B}: {fmt(rec, 'ms', '{:.1f} ms')}", flush=True)
        save()


def table_train(results):
    print_table("Training step (forward + backward + AdamW, bf16 autocast, fp32 weights)",
                ["model", "T", "batch", "ms/step", "tokens/s", "FLOP/step", "MFU", "peak GB",
                 "compiled"],
                [[r["attn"], r["T"], r["batch"], fmt(r, "ms", "{:.1f}"),
                  fmt(r, "tokens_per_s", "{:.0f}"), fmt(r, "flops_per_step", "{:.3g}"),
                  fmt(r, "mfu", "{:.1%}"), fmt(r, "peak_mem_gb", "{:.2f}"),
                  fmt(r, "compiled", "{}")] for r in results["train"]])


# -- Output ----------------------------------------------------------------------------------

def fmt(rec, key, spec):
    """rec[key] formatted, or the record's status (OOM, error) where it has none."""
    if rec.get(key) is not None:
        return spec.format(rec[key])
    return "-" if rec.get("status", "ok") == "ok" else rec["status"].split(":")[0].split(" (")[0]


def print_table(title, header, rows):
    """Columns as wide as their widest cell, right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, *rows]:
        print(" | ".join(f"{cell!s:>{w}}" for cell, w in zip(row, widths)), flush=True)


def figure(path, *args, **kwargs):
    """(pyplot, figure, axes) of plt.subplots(*args, **kwargs); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"NOTE: matplotlib is not installed; no plot written to {path}", flush=True)
        return None
    return (plt, *plt.subplots(*args, **kwargs))


def save_figure(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def plot_prefill(results, path):
    """Prefill time against prompt length, log-log, one line per model."""
    if not (made := figure(path, figsize=(6, 4.5))):
        return
    plt, fig, ax = made
    for attn in MODELS:
        pts = sorted((r["T"], r["ms"]) for r in results["prefill"]
                     if r["attn"] == attn and r.get("ms"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=attn)
    ax.set(xscale="log", yscale="log", xlabel="prompt length T (tokens)",
           ylabel="prefill time (ms)", title="Prefill latency, batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def plot_decode(results, path):
    """Per (ctx, batch): tokens/s (hatched: naive), Orthros / Transformer, the HBM fraction."""
    groups = sorted(dict.fromkeys((r["ctx"], r["batch"]) for r in results["decode"]))
    if not (made := figure(path, 3, 1, figsize=(max(8, 1.8 * len(groups) + 3), 11), sharex=True)):
        return
    plt, fig, axes = made
    variants = list(dict.fromkeys(r["variant"] for r in results["decode"]))
    recs = {(r["attn"], r["variant"], r["ctx"], r["batch"]): r for r in results["decode"]}
    get = lambda attn, v, key, missing=float("nan"): [
        recs.get((attn, v) + g, {}).get(key) or missing for g in groups]
    width = 0.8 / (len(MODELS) * len(variants))
    for i, (attn, v) in enumerate((a, v) for a in MODELS for v in variants):
        axes[0].bar([g + (i + 0.5) * width - 0.4 for g in range(len(groups))],
                    get(attn, v, "tokens_per_s", missing=0), width, label=f"{attn}, {v}",
                    color=f"C{MODELS.index(attn)}", hatch="//" if v == "naive" else None,
                    alpha=1 - 0.6 * variants.index(v) / len(variants))
    for j, v in enumerate(variants):
        xs = [g + (j + 0.5) * 0.8 / len(variants) - 0.4 for g in range(len(groups))]
        ratio = [o / t for o, t in zip(get("orthros", v, "tokens_per_s"),
                                       get("transformer", v, "tokens_per_s"))]
        axes[1].plot(xs, ratio, "o", color=f"C{j}", label=v)
        for attn, marker in (("transformer", "s"), ("orthros", "o")) if "fast" in v else ():
            axes[2].plot(xs, get(attn, v, "hbm_fraction"), marker, color=f"C{j}",
                         label=f"{attn}, {v}")
    axes[1].axhline(0.95, color="gray", ls="--", lw=1)
    axes[0].set(yscale="log", ylabel="tokens/s", title="Decode speed (hatched: naive KV cache)")
    axes[1].set(ylabel="orthros / transformer",
                title="Orthros / Transformer, tokens/s (dashed: 0.95)")
    axes[2].set(ylabel="fraction of HBM limit", ylim=(0, 1), xlabel="context x batch",
                title="Fast decoder: fraction of the HBM-bandwidth limit")
    axes[2].set_xticks(range(len(groups)), [f"{c // 1024}K x {b}" if c >= 1024 else f"{c} x {b}"
                                            for c, b in groups])
    for ax, size, ncol in zip(axes, (6, 7, 6), (3, 2, 2)):
        ax.legend(fontsize=size, ncol=ncol)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    save_figure(plt, fig, path)


SECTIONS = {"prefill": (bench_prefill, table_prefill), "decode": (bench_decode, table_decode),
            "train": (bench_train, table_train)}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(name, default, help, **kw):  # the option's type is its default's; False: a flag
        if isinstance(default, bool):
            kw["action"] = "store_true"
        elif default is not None:
            kw.setdefault("type", type(default))
        p.add_argument(f"--{name}", default=default, help=help, **kw)

    add("device", "auto", "auto (cuda if available), cpu, cuda or cuda:N")
    add("dtype", "bfloat16", "weights of prefill and decode (train: fp32 and bf16 autocast)",
        choices=["bfloat16", "float16", "float32"])
    add("n_layer", 12, "layers")
    add("n_embd", 768, "model width C")
    add("n_head", 6, "heads (head dim = n_embd / n_head)")
    add("vocab_size", 50304, "vocabulary size")
    add("window", 128, "sliding window w (orthros and swa)")
    add("prefill_lens", "8192,16384,32768,65536,131072,262144,524288,1048576,2097152",
        "comma-separated prompt lengths")
    add("long_T", 262144, "prompts longer than this run --long_reps times after --long_warmup")
    add("long_reps", 1, "timed runs of a prompt longer than --long_T")
    add("long_warmup", 0, "warm-up calls of a prompt longer than --long_T")
    add("decode_ctx", "4096,32768,131072", "comma-separated context lengths for decoding")
    add("decode_batches", "1,8", "comma-separated decode batch sizes")
    add("decode_steps", 50, "timed decode steps per run")
    add("decode_reps", 3, "interleaved rounds per (model, variant, ctx, batch); the median counts")
    add("decode_variants", ",".join(VARIANTS), f"comma-separated subset of {','.join(VARIANTS)}")
    add("decode_cache", "prefill", "each round's prompt cache: model.prefill of a random prompt, "
        "or random keys and values (a Transformer prefill of 128K x 8 takes seconds)",
        choices=["prefill", "random"])
    add("time_budget", 0.0, "seconds from the start: no decode round after a setting's first "
        "that would end past it (by its fastest round so far); 0: no limit")
    add("profile", False, "also profile 20 steps of each fast decoder's kernels")
    add("gptfast", None, "a folder with gpt-fast's model.py: time its decode loop beside ours")
    add("hbm_tbps", 4.8, "HBM bandwidth in TB/s, for hbm_fraction (H200: 4.8, H100 SXM: 3.35)")
    add("train_T", 2048, "training sequence length")
    add("train_batch", 8, "training batch size")
    add("reps", 5, "timed runs (median) of prefill and training")
    add("warmup", 2, "untimed calls before each timing")
    add("models", ",".join(MODELS), "comma-separated models to run (every section)")
    add("sections", ",".join(SECTIONS), "comma-separated subset of prefill,decode,train")
    add("compile", False, "compile_blocks every model in the prefill and train sections")
    add("out", "bench.json", "the JSON; the plots go beside it (<stem>_prefill.png, _decode.png)")
    add("out_png", None, "the prefill plot (needs matplotlib); '' for none")
    add("out_decode_png", None, "the decode plot (needs matplotlib); '' for none")
    add("tiny", False, f"a small preset for a CPU smoke run: {TINY}")
    if p.parse_known_args(argv)[0].tiny:
        p.set_defaults(**TINY)  # options given still win over the preset
    args = p.parse_args(argv)
    for name, allowed in ("sections", SECTIONS), ("models", MODELS), ("decode_variants", VARIANTS):
        given = [x for x in getattr(args, name).split(",") if x]
        if not given or set(given) - set(allowed):
            p.error(f"--{name} takes a comma-separated subset of {','.join(allowed)}, "
                    f"got {getattr(args, name)!r}")
        setattr(args, name, given)
    for name in ("prefill_lens", "decode_ctx", "decode_batches"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",") if x])
    if min(args.reps, args.long_reps, args.decode_steps, args.decode_reps, args.train_batch,
           args.train_T, *args.prefill_lens, *args.decode_ctx, *args.decode_batches) < 1 \
            or min(args.warmup, args.long_warmup) < 0:
        p.error("lengths, batch sizes, --reps, --long_reps, --decode_steps and --decode_reps must "
                "be >= 1, --warmup and --long_warmup >= 0")
    stem = str(Path(args.out).with_suffix(""))
    for name, suffix in (("out_png", "_prefill.png"), ("out_decode_png", "_decode.png")):
        if getattr(args, name) is None:
            setattr(args, name, stem + suffix)
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    t_start = time.time()  # --time_budget counts from here
    args = parse_args(argv)
    args.t_start, device = t_start, torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    # Long enough for every prompt, every decode run (prompt + warm-up + timed steps), training.
    args.max_seq_len = max(args.prefill_lens + [args.train_T] + [
        c + args.warmup + args.decode_steps + 1 for c in args.decode_ctx])
    torch.set_float32_matmul_precision("high")
    if args.compile or "fast+compile" in args.decode_variants:
        # three models x prefill/decode/train shapes: more graphs than the default limit of 8
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    results = {"meta": run_meta(device), "prefill": [], "prefill_speedup": [], "decode": [],
               "train": [], "args": {k: str(v) if isinstance(v, torch.dtype) else v
                                     for k, v in vars(args).items()}}

    def save():  # atomic: a run killed mid-write keeps the last good JSON
        atomic_write(args.out, lambda f: json.dump(results, f, indent=1), mode="w")

    print(results["meta"], flush=True)
    for name in args.sections:
        try:
            SECTIONS[name][0](args, device, results, save)
        except Exception:  # keep what was measured, and go on to the next section
            traceback.print_exc()
            print(f"NOTE: the {name} section stopped on the error above", flush=True)
            free_memory(device)
        print(f"-- {name} done at {time.time() - t_start:.0f} s", flush=True)
    print("\n==== summary ====")
    for name in args.sections:
        SECTIONS[name][1](results)
    save()
    print(f"\nwrote {args.out}", flush=True)
    if args.out_png and results["prefill"]:
        plot_prefill(results, args.out_png)
    if args.out_decode_png and results["decode"]:
        plot_decode(results, args.out_decode_png)
    return results


if __name__ == "__main__":
    main()
