"""
Benchmark Orthros against the Transformer and SWA baselines at one model size, in one process.

Sections (pick with --sections):
  prefill  latency of model.prefill(idx) at --batch (1) for each T in --prefill_lens (8K ... 2M), the
           speedup over the Transformer, and the FLOP-count limit of that speedup (prefill_flop_limits).
           Prompts longer than --long_T run --long_reps times after --long_warmup warm-up calls (a
           Transformer prefill of 1M tokens takes ~40 s); a length that does not fit in memory is
           recorded as OOM, and longer ones are skipped for that model only
  decode   tokens/s of both decoders, the naive KV cache (model.decode) and engine.FastDecoder (static
           cache, one FlexAttention call per layer, one CUDA graph), each with eager and compiled
           layers (--decode_variants), after a prompt of each --decode_ctx, at each --decode_batches.
           The fast one is built for each context (max_len = context + new tokens), as sample.py
           and gpt-fast build theirs; --gptfast DIR adds gpt-fast's decode loop. A round makes one
           prompt cache per model and setting (--decode_cache: a prefill, or random keys and values)
           and times every variant from it; --decode_reps rounds, interleaved, median; with
           ms/step, the fraction of the HBM-bandwidth limit (hbm_fraction) and the number of
           graphs compiled during the timed steps (0: no recompiling per step)
  train    forward + backward + AdamW step at --train_T: ms, tokens/s and MFU
Every measurement also records the peak GPU memory. Results are printed as they come, and the
JSON file is rewritten after every measurement, so a run cut short by a timeout keeps its figures.

    python perf/bench.py --compile                 # the paper size on a GPU (12 layers, d=768, w=128)
    python perf/bench.py --tiny --device cpu       # a CPU smoke run of every line, < 1 minute
    python perf/bench.py --sections prefill --prefill_lens 8192,32768

Runtime on one H200 (estimated from the measurements in results/h200/; each section fits one 10-minute
call, all three together do not): prefill with --compile ~5 min (T <= 256K ~1 min; the Transformer at
512K, 1M, 2M ~10 s, ~40 s, ~160 s, one call each); train ~1 min. The decode matrix with its
recompile log (--time_budget keeps it inside one call):

    TORCH_LOGS=recompiles python perf/bench.py --sections decode --decode_ctx 131072,32768,4096 \
        --decode_cache random --decode_steps 40 --decode_variants naive,fast,fast+compile \
        --time_budget 300 --out out/bench_decode.json 2> out/recompiles.log
"""

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python perf/bench.py): import from the repository root
from data.prepare_utils import atomic_write
from orthros import KVCache, Orthros, OrthrosConfig, compile_blocks
from perf.engine import FastDecoder
from perf.flops import prefill_flop_limits, train_flops
from checkpoint import pick_device, run_meta, sync

MODELS = ("transformer", "orthros", "swa")  # the Transformer first: the others' speedups need it
DECODE_VARIANTS = ("naive", "naive+compile", "fast", "fast+compile")  # model.decode with the KVCache, or
# engine.FastDecoder; +compile: compiled layers (compile_blocks for naive, FastDecoder(compile=True) for fast)
TINY = dict(n_layer=2, n_embd=128, n_head=2, window=16, vocab_size=4096, prefill_lens="256,512,1024",
            long_T=512, decode_ctx="64,128", decode_batches="1,2", decode_steps=8, train_T=256, train_batch=2,
            reps=3, decode_variants="naive,fast")


# -----------------------------------------------------------------------------
# Bytes a decode step must read

def decode_bytes(cfg, n_params, batch, keys, dtype_bytes=2):
    """The fewest bytes one decode step must read from GPU memory: every weight once, plus the
    keys and values the new token attends.
      weight bytes = n_params * dtype_bytes (the tied embedding counts once: the LM head reads all
        of it, the embedding lookup only B rows);
      KV bytes = n_layer * 2 (K and V) * batch * keys_read * kv_width * dtype_bytes, where keys_read
        is the valid prefix `keys` for the Transformer and Orthros (the base twin's window lies
        inside the prefix that the output twin reads), and min(keys, window) for SWA; kv_width =
        n_embd, or n_kv_head * head_dim with grouped-query attention.
    Rows read past the valid prefix (the rest of the fast decoder's last key block) and the naive
    cache's copies are not counted: they are overhead, not work."""
    keys_read = min(keys, cfg.window) if cfg.attn == "swa" else keys
    D = getattr(cfg, "head_dim", None) or cfg.n_embd // cfg.n_head
    kv_width = D * (getattr(cfg, "n_kv_head", None) or cfg.n_head)
    return n_params * dtype_bytes + cfg.n_layer * 2 * batch * keys_read * kv_width * dtype_bytes


def hbm_fraction(cfg, n_params, batch, keys, sec_per_step, hbm_bytes_per_s, dtype_bytes=2):
    """The fraction of the HBM-bandwidth limit a decode step reaches:
        decode_bytes(...) / seconds per step / bandwidth   (H200: 4.8e12 bytes/s).
    1.0 would mean the step only streams its weights and valid KV cache at full bandwidth."""
    return decode_bytes(cfg, n_params, batch, keys, dtype_bytes) / sec_per_step / hbm_bytes_per_s


# -----------------------------------------------------------------------------
# Timing and memory helpers

def time_fn(fn, device, reps, warmup):
    """Median seconds of fn() over reps calls, after warmup calls (kernel selection, allocator,
    lazy init). Synchronizing around each call times the GPU work, not just the launches."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device):
    """Run fn() -> dict of figures, adding "status" ("ok", "OOM" or the error) and the peak GPU
    memory in GB. Errors are recorded rather than raised, so one failure costs one figure."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        result = {**fn(), "status": "ok"}
    except Exception as e:  # NOTE: tensors held by the traceback are freed when this block ends
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        if not oom:
            traceback.print_exc()
        result = {"status": "OOM" if oom else f"error: {type(e).__name__}: {e}"[:300]}
    if device.type == "cuda" and result["status"] == "ok":
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    free_memory(device)
    return result


def make_config(args, attn):
    return OrthrosConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd, window=args.window, attn=attn, max_seq_len=args.max_seq_len)


def build_model(args, attn, dtype, device, compile=None):
    """The model for attn, seeded (the same weights every call); compile (default --compile):
    compile_blocks it."""
    torch.manual_seed(0)
    with torch.device(device):  # initialize the weights on the device directly: much faster
        model = Orthros(make_config(args, attn))
    model = model.to(dtype)
    if args.compile if compile is None else compile:  # fuse each block's elementwise work; the warm-up calls absorb compile time
        compile_blocks(model)
    return model


def random_tokens(args, batch, T, device):
    return torch.randint(0, args.vocab_size, (batch, T), device=device)


# -----------------------------------------------------------------------------
# The three sections. Each appends records (dicts) to results[section] and calls save().

def bench_prefill(args, device, results, save):
    for attn in args.models:
        model = build_model(args, attn, args.dtype, device).eval()
        oom_T = float("inf")  # the shortest prompt that ran out of memory
        for T in args.prefill_lens:
            rec = {"attn": attn, "T": T, "batch": args.batch}
            # NOTE: above long_T the kernels and compiled graphs are warm from the shorter lengths
            # (they run first), and one Transformer prefill takes seconds to minutes: fewer runs.
            reps, warmup = (args.long_reps, args.long_warmup) if T > args.long_T else (args.reps, args.warmup)
            if T >= oom_T:  # a longer prompt cannot fit either: don't spend the time finding out
                rec["status"] = "OOM (skipped: a shorter T ran out of memory)"
            else:
                idx = random_tokens(args, args.batch, T, device)
                def run():
                    with torch.inference_mode():
                        return {"ms": 1e3 * time_fn(lambda: model.prefill(idx), device, reps, warmup),
                                "reps": reps, "warmup": warmup}
                rec.update(measure(run, device))
                if rec["status"] == "OOM":
                    oom_T = min(oom_T, T)
                    print(f"NOTE: prefill of {T} tokens does not fit in memory for {attn}; "
                          "longer prompts are skipped for this model", flush=True)
                del idx
            results["prefill"].append(rec)
            print(f"prefill {attn:>11} T={T:>7}: {fmt(rec, 'ms', '{:.2f} ms')}  {fmt(rec, 'peak_mem_gb', '{:.2f} GB')}", flush=True)
            save()
        model = None  # free it before the next model (the closures above refer to the name)
        free_memory(device)
    # Speedups over the Transformer, next to their FLOP-count limits.
    ms = {(r["attn"], r["T"]): r.get("ms") for r in results["prefill"]}
    cfg = make_config(args, "orthros")
    for T in args.prefill_lens:
        rec = {"T": T}
        for attn in ("orthros", "swa"):
            ref, mine = ms.get(("transformer", T)), ms.get((attn, T))
            rec[f"{attn}_speedup"] = ref / mine if ref and mine else None
            rec[f"{attn}_flop_limit"], rec[f"{attn}_flop_limit_lm_head_all_tokens"] = prefill_flop_limits(cfg, T, attn)
        results["prefill_speedup"].append(rec)
    save()


# -- The decode section ---------------------------------------------------------------------

class PromptCache:
    """A decoder for model.generate_tokens whose prefill() hands out a prompt's cache made once
    (prompt_cache) instead of running the model: every decoder of a round starts from the same
    cache, and the decode loop is still the model's own, as in sample.py. (A FastDecoder takes
    the prompt's cache itself: generate_tokens(..., prompt=(logits, cache)) copies it into its static cache.)"""

    def __init__(self, model, logits, cache):
        self.model, self.logits, self.cache = model, logits, cache

    def prefill(self, idx):
        # The naive cache appends by concatenation (new tensors): a new KVCache over the same
        # tensors leaves the shared one as it was.
        copy = KVCache(self.model, self.cache.batch_size)
        for src, dst in zip(self.cache.layers, copy.layers):
            dst.__dict__.update(src.__dict__)   # k, v (and conv_state)
        copy.length = self.cache.length
        return self.logits, copy

    def decode(self, next_idx, state):
        return self.model.decode(next_idx, state)


def prompt_cache(args, model, ctx, B, device):
    """(logits (B, 1, vocab), KVCache of ctx positions) for a random prompt: model.prefill's
    (--decode_cache prefill), or random keys and values with random logits (--decode_cache random:
    a decode step's time does not depend on the values; no prefill to wait for)."""
    with torch.inference_mode():
        if args.decode_cache == "prefill":
            return model.prefill(random_tokens(args, B, ctx, device))
        cfg = model.config
        cache = KVCache(model, B)
        shape = (B, cfg.n_head, ctx, cfg.n_embd // cfg.n_head)
        for layer in cache.layers:
            layer.k = torch.randn(shape, device=device, dtype=args.dtype)
            layer.v = torch.randn(shape, device=device, dtype=args.dtype)
            if cfg.conv_kernel:
                layer.conv_state = torch.randn(B, cfg.conv_kernel - 1, cfg.n_embd, device=device, dtype=args.dtype)
        cache.length = ctx
        return torch.randn(B, 1, cfg.vocab_size, device=device, dtype=args.dtype), cache


def unique_graphs():
    """How many graphs torch.compile has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def decode_run(args, model, variant, prompt, B, device):
    """Time args.decode_steps greedy decode steps (after args.warmup untimed ones, which include
    the fast decoder's graph capture and any compilation) after the prompt's cache, through the
    decode loop of sample.py: model.generate_tokens (naive), or FastDecoder(model, B, max_len=the
    context + new tokens, compile=..., kernel_options=...).generate_tokens (fast)."""
    logits, cache = prompt
    ctx, n_steps = cache.length, args.warmup + args.decode_steps
    idx = torch.zeros(1, 1, dtype=torch.long, device=device).expand(B, ctx)  # the prompt's shape: prefill() ignores it
    graphs = unique_graphs()
    with torch.inference_mode():
        t_first = time.perf_counter()
        if variant.decoder == "fast":
            fast = FastDecoder(model, B, max_len=ctx + n_steps + 1, compile=variant.compiled,
                               kernel_options=args.kernel_options)
            tokens = fast.generate_tokens(idx, n_steps + 1, temperature=0, prompt=(logits, cache))
        else:
            tokens = model.generate_tokens(idx, n_steps + 1, temperature=0, decoder=PromptCache(model, logits, cache))
        # generate_tokens yields its first token after prefill, then one after each decode step
        for step, _ in enumerate(tokens):
            if step == 0 and device.type == "cuda":  # the peak of the decode phase: cache + one step
                torch.cuda.reset_peak_memory_stats(device)
            if step == args.warmup:
                sync(device)
                t0 = time.perf_counter()
                graphs_warm = unique_graphs()
        sync(device)
        dt = time.perf_counter() - t0
        rec = {"tokens_per_s": B * args.decode_steps / dt, "ms_per_step": 1e3 * dt / args.decode_steps,
               "warmup_s": t0 - t_first, "compiles_warmup": graphs_warm - graphs, "compiles_timed": unique_graphs() - graphs_warm}
        if args.profile and variant.decoder == "fast" and device.type == "cuda":
            try:
                rec["kernels"] = profile_steps(fast, 20, device)
            except Exception as e:   # the timing above stands
                rec["kernels"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return rec


def profile_steps(fast, n_steps, device):
    """The GPU kernels of n_steps of a warm decoder's steps (its CUDA graph replayed) under torch.profiler: per step,
    microseconds and launches of each kernel name, FlexAttention's (names with "flex") apart."""
    from torch.profiler import ProfilerActivity, profile
    fast.pos.sub_(n_steps)   # stay inside the cache: the steps rewrite rows already decoded
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            fast._run(0, None)
        sync(device)
    kernels = {e.key: (e.device_time_total / n_steps, e.count / n_steps) for e in prof.key_averages()
               if e.device_time_total > 0}
    flex = sum(us for name, (us, _) in kernels.items() if "flex" in name.lower())
    return {"us_per_step": sum(us for us, _ in kernels.values()), "launches_per_step": sum(n for _, n in kernels.values()),
            "flex_us_per_step": flex, "top": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A decoder as the decode section runs it: naive or fast, eager or compiled layers."""
    decoder: str
    compiled: bool

    def label(self):
        return self.decoder + ("+compile" if self.compiled and self.decoder != "gpt-fast" else "")


def gptfast_run(args, ctx, B, device):
    """pytorch-labs/gpt-fast's decode loop (generate.py's decode_n_tokens, greedy) on the bench model's shape, its
    model.py read from --gptfast DIR (not part of this repository): a static cache of ctx + new tokens with random
    keys and values, decode_one_token compiled with mode="reduce-overhead" and fullgraph, coordinate-descent tuning,
    the math SDPA inside it, as gpt-fast runs them. SwiGLU of width 2048 has the GELU MLP's 4C x C x 2 weights."""
    sys.path.insert(0, args.gptfast)
    from model import ModelArgs, Transformer   # gpt-fast's
    import torch._inductor.config
    torch._inductor.config.coordinate_descent_tuning = True
    n_steps = args.warmup + args.decode_steps
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelArgs(block_size=ctx + n_steps + 1, vocab_size=args.vocab_size, n_layer=args.n_layer,
                                      n_head=args.n_head, dim=args.n_embd, intermediate_size=8 * args.n_embd // 3))
        model.setup_caches(B, ctx + n_steps + 1)
    model = model.to(args.dtype).eval()
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.normal_()
        layer.attention.kv_cache.v_cache.normal_()
    step = torch.compile(lambda x, pos: model(x, pos)[:, -1].argmax(-1, keepdim=True), mode="reduce-overhead",
                         fullgraph=True)
    token, pos = torch.zeros(B, 1, dtype=torch.long, device=device), torch.tensor([ctx], device=device)
    graphs, t_first = unique_graphs(), time.perf_counter()
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
        for i in range(n_steps):
            if i == args.warmup:
                sync(device)
                t0, graphs_warm = time.perf_counter(), unique_graphs()
            token = step(token, pos).clone()
            pos += 1
        sync(device)
    dt = time.perf_counter() - t0
    torch._inductor.config.coordinate_descent_tuning = False
    return {"tokens_per_s": B * args.decode_steps / dt, "ms_per_step": 1e3 * dt / args.decode_steps,
            "warmup_s": t0 - t_first, "compiles_warmup": graphs_warm - graphs, "compiles_timed": unique_graphs() - graphs_warm}


def measure_run(fn, device):
    """measure() for one decode run, without its gc and cache flushes per call (a few hundred
    runs): figures + "status" + peak GPU memory; an error is recorded, not raised."""
    try:
        rec = {**fn(), "status": "ok"}
        gc.collect()  # a compiled decoder's cache is held in cycles that Dynamo's tracing leaves: free it now
        if device.type == "cuda":
            rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        return rec
    except Exception as e:
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        if not oom:
            traceback.print_exc()
        status = "OOM" if oom else f"error: {type(e).__name__}: {e}"[:300]
    free_memory(device)  # what the traceback held
    return {"status": status}


def bench_decode(args, device, results, save):
    """Every (ctx, batch) x model x variant, --decode_reps rounds. A round runs each (ctx, batch)
    once: per model one prompt cache (prompt_cache), then every variant's decoder from it, in
    turn (interleaved, so a slow spell of the machine hits all alike); the median is reported.
    Rounds are the outer loop, and the first always runs whole: a --time_budget that runs out
    leaves every setting with at least its first round; a later round of a (ctx, batch) that
    would not fit (by its fastest round so far) is skipped."""
    t_start = time.time()
    models = {attn: build_model(args, attn, args.dtype, device, compile=False).eval() for attn in args.models}
    twins = {}  # the same weights with compiled blocks, for naive+compile (compile_blocks is in place)
    if "naive+compile" in args.decode_variants:
        for attn in args.models:
            twins[attn] = build_model(args, attn, args.dtype, device, compile=False).eval()
            twins[attn].load_state_dict(models[attn].state_dict())
            compile_blocks(twins[attn])
    settings = [(ctx, B) for ctx in args.decode_ctx for B in args.decode_batches]
    variants = [Variant(name.split("+")[0], name.endswith("+compile")) for name in args.decode_variants]
    runs = {}           # (ctx, B, attn, Variant) -> [record per round]
    round_s = {}        # (ctx, B) -> seconds its fastest round took
    n_params = {attn: sum(p.numel() for p in m.parameters()) for attn, m in models.items()}
    results["decode_meta"] = {
        "decode_cache": {"prefill": "model.prefill of a random prompt, once per model, (ctx, batch) and round; "
                                    "every decoder of the round starts from a copy of that cache",
                         "random": "random keys and values (N(0, 1)) and random logits, once per model, (ctx, batch) "
                                   "and round, instead of a prefill; every decoder of the round starts from a copy"
                         }[args.decode_cache],
        "fast_decoder": f"FastDecoder(model, batch, max_len=context + new tokens, compile=..., "
                        f"kernel_options={args.kernel_options}), as sample.py builds it",
        "time_budget_s": args.time_budget, "skipped": []}

    def summarize():
        results["decode"] = []
        for (ctx, B, attn, var), recs in runs.items():
            rec = {"attn": attn, "variant": var.label(), "decoder": var.decoder,
                   "layers": "compiled" if var.compiled else "eager", "ctx": ctx, "batch": B, "steps": args.decode_steps}
            rec.update(summarize_runs(recs))
            if rec.get("ms_per_step") and attn in models:
                keys = ctx + args.warmup + (args.decode_steps + 1) / 2  # mean valid prefix of the timed steps
                rec["hbm_fraction"] = hbm_fraction(models[attn].config, n_params[attn], B, keys, rec["ms_per_step"] / 1e3,
                                                   args.hbm_tbps * 1e12, torch.finfo(args.dtype).bits // 8)
            results["decode"].append(rec)
        save()

    for rnd in range(args.decode_reps):
        for ctx, B in settings:
            elapsed = time.time() - args.t_start
            if rnd and args.time_budget and elapsed + round_s[ctx, B] > args.time_budget:
                results["decode_meta"]["skipped"].append({"ctx": ctx, "batch": B, "round": rnd + 1})
                print(f"NOTE: decode ctx={ctx} B={B} round {rnd + 1} skipped: --time_budget {args.time_budget} s "
                      f"({elapsed:.0f} s spent)", flush=True)
                continue
            t0 = time.time()
            line = []
            free_memory(device)
            for attn in args.models:
                try:
                    prompt = prompt_cache(args, models[attn], ctx, B, device)
                except Exception as e:  # e.g. OOM: every variant of this model fails alike
                    prompt = e
                for var in variants:
                    model = twins[attn] if var.decoder == "naive" and var.compiled else models[attn]
                    if isinstance(prompt, Exception):
                        rec = {"status": f"prompt cache failed: {type(prompt).__name__}: {prompt}"[:300]}
                    else:
                        rec = measure_run(lambda: decode_run(args, model, var, prompt, B, device), device)
                    runs.setdefault((ctx, B, attn, var), []).append(rec)
                    line.append(f"{attn} {var.label()}: {fmt(rec, 'tokens_per_s', '{:.0f}')}")
                prompt = None
            if args.gptfast:
                rec = measure_run(lambda: gptfast_run(args, ctx, B, device), device)
                runs.setdefault((ctx, B, "transformer", Variant("gpt-fast", True)), []).append(rec)
                line.append(f"gpt-fast: {fmt(rec, 'tokens_per_s', '{:.0f}')}")
            round_s[ctx, B] = min(round_s.get((ctx, B), float("inf")), time.time() - t0)
            print(f"decode round {rnd + 1} ctx={ctx:>6} B={B} ({time.time() - t0:.1f} s), tok/s: " + "; ".join(line), flush=True)
            summarize()
        if args.out_decode_png and results["decode"]:  # a run cut short still leaves a plot
            save_decode_plot(results, args.out_decode_png)
    summarize()
    print(f"-- decode: {time.time() - t_start:.0f} s", flush=True)
    models = twins = None
    free_memory(device)


def summarize_runs(recs):
    """The median tokens/s and ms/step over the runs that succeeded, the largest peak memory, every
    run's tokens/s, the compiles during timed steps (should be 0); the first failure's status when
    none succeeded."""
    ok = [r for r in recs if r["status"] == "ok"]
    if not ok:
        return {"status": recs[0]["status"], "runs": len(recs)}
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
           "ms_per_step": statistics.median(r["ms_per_step"] for r in ok),
           "runs_tokens_per_s": [r["tokens_per_s"] for r in ok], "runs": len(recs), "status": "ok",
           "warmup_s": [round(r["warmup_s"], 3) for r in ok],
           "compiles_warmup": sum(r["compiles_warmup"] for r in ok),
           "compiles_timed": sum(r["compiles_timed"] for r in ok)}
    if ok[-1].get("kernels"):
        out["kernels"] = ok[-1]["kernels"]
    if any("peak_mem_gb" in r for r in ok):
        out["peak_mem_gb"] = max(r.get("peak_mem_gb", 0) for r in ok)
    if len(ok) < len(recs):
        out["failed_runs"] = [r["status"] for r in recs if r["status"] != "ok"]
    return out


def bench_train(args, device, results, save):
    T, B = args.train_T, args.train_batch
    for attn in args.models:
        rec = {"attn": attn, "T": T, "batch": B}

        def run():
            model = build_model(args, attn, torch.float32, device).train()  # fp32 master weights
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            idx = random_tokens(args, B, T + 1, device)
            x, y = idx[:, :-1], idx[:, 1:]

            def step(m):
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    _, loss = m(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            sec = time_fn(lambda: step(model), device, args.reps, args.warmup + 1)
            flops = train_flops(model.config, T, B)
            return {"ms": 1e3 * sec, "tokens_per_s": B * T / sec, "flops_per_step": flops,
                    "mfu": flops / sec / (args.peak_tflops * 1e12), "compiled": args.compile}

        rec.update(measure(run, device))
        results["train"].append(rec)
        print(f"train   {attn:>11} T={T} B={B}: {fmt(rec, 'ms', '{:.1f} ms')} {fmt(rec, 'tokens_per_s', '{:.0f} tok/s')} "
              f"MFU {fmt(rec, 'mfu', '{:.1%}')}  {fmt(rec, 'peak_mem_gb', '{:.2f} GB')}", flush=True)
        save()


# -----------------------------------------------------------------------------
# Output: tables, JSON, plot

def fmt(rec, key, spec):
    """rec[key] formatted, or the record's status (OOM, error) when the figure is missing."""
    if rec.get(key) is not None:
        return spec.format(rec[key])
    return "-" if rec.get("status", "ok") == "ok" else rec["status"].split(":")[0].split(" (")[0]


def print_tables(results, sections=("prefill", "decode", "train")):
    rows = {(r["attn"], r["T"]): r for r in results["prefill"]}
    if "prefill" in sections and results["prefill_speedup"]:
        print(f"\nPrefill latency, batch {results['args']['batch']} (ms; peak GB incl. weights), speedup over the Transformer [FLOP limit; "
              "limit with the LM head on every token]")
        print(f"{'T':>7} | " + " | ".join(f"{a:>20}" for a in MODELS) + f" | {'orthros x [limit; all]':>24} | {'swa x [limit; all]':>24}")
        for s in results["prefill_speedup"]:
            cells = [f"{fmt(rows.get((a, s['T']), {}), 'ms', '{:.2f}'):>10} {fmt(rows.get((a, s['T']), {}), 'peak_mem_gb', '({:.1f})'):>9}"
                     for a in MODELS]
            spd = [f"{fmt(s, f'{a}_speedup', '{:.2f}x'):>6} [{s[f'{a}_flop_limit']:.1f}; {s[f'{a}_flop_limit_lm_head_all_tokens']:.1f}]"
                   for a in ("orthros", "swa")]
            print(f"{s['T']:>7} | " + " | ".join(cells) + " | " + " | ".join(f"{c:>24}" for c in spd))
    if "decode" in sections and results["decode"]:
        print("\nDecode, tokens/s (median of the interleaved rounds) [fraction of the HBM-bandwidth limit] ms/step; "
              "naive = model.decode with the KVCache, fast = engine.FastDecoder, +compile = compiled layers")
        rows = {(r["attn"], r["variant"], r["ctx"], r["batch"]): r for r in results["decode"]}
        variants = list(dict.fromkeys(r["variant"] for r in results["decode"]))
        width = max(len(v) for v in variants + ["variant"])
        print(f"{'ctx':>7} {'batch':>5} {'variant':<{width}} | " + " | ".join(f"{a:>24}" for a in MODELS)
              + f" | {'orthros/transformer':>19} | peak GB")
        for ctx, B in sorted(dict.fromkeys((r["ctx"], r["batch"]) for r in results["decode"])):
            for v in variants:
                recs = [rows.get((a, v, ctx, B), {}) for a in MODELS]
                if not any(recs):
                    continue
                cells = [f"{fmt(r, 'tokens_per_s', '{:.0f}'):>8} {fmt(r, 'hbm_fraction', '[{:.0%}]'):>6} "
                         f"{fmt(r, 'ms_per_step', '{:.2f}'):>8}" if r else f"{'':>24}" for r in recs]
                t, o = (recs[MODELS.index(a)].get("tokens_per_s") for a in ("transformer", "orthros"))
                peaks = " ".join(fmt(r, "peak_mem_gb", "{:.1f}") for r in recs if r)
                print(f"{ctx:>7} {B:>5} {v:<{width}} | " + " | ".join(cells)
                      + f" | {f'{o / t:.2f}' if t and o else '-':>19} | {peaks}")
        for r in results["decode"]:
            if r.get("kernels", {}).get("us_per_step"):
                k = r["kernels"]
                print(f"profile {r['attn']} {r['variant']} ctx={r['ctx']} B={r['batch']}: {k['launches_per_step']:.0f} kernels, "
                      f"{k['us_per_step']:.0f} us a step, of which FlexAttention's {k['flex_us_per_step']:.0f} us")
        timed = [f"{r['attn']} {r['variant']} ctx={r['ctx']} B={r['batch']}: {r['compiles_timed']}"
                 for r in results["decode"] if r.get("compiles_timed")]
        print("compiled graphs during timed steps: " + ("; ".join(timed) if timed else "none"))
    if "train" in sections and results["train"]:
        print("\nTraining step (forward + backward + AdamW, bf16 autocast, fp32 weights)")
        print(f"{'model':>11} | {'T':>6} {'batch':>5} | {'ms/step':>9} {'tokens/s':>10} {'TFLOP/step':>10} {'MFU':>7} {'peak GB':>8} {'compiled':>8}")
        for r in results["train"]:
            tflop = f"{r['flops_per_step'] / 1e12:.3g}" if r.get("flops_per_step") else "-"
            print(f"{r['attn']:>11} | {r['T']:>6} {r['batch']:>5} | {fmt(r, 'ms', '{:.1f}'):>9} {fmt(r, 'tokens_per_s', '{:.0f}'):>10} "
                  f"{tflop:>10} {fmt(r, 'mfu', '{:.1%}'):>7} {fmt(r, 'peak_mem_gb', '{:.2f}'):>8} {fmt(r, 'compiled', '{}'):>8}")


def _pyplot(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"NOTE: matplotlib is not installed; no plot written to {path}", flush=True)
        return None


def save_prefill_plot(results, path):
    """Prefill time against prompt length, log-log, one line per model."""
    plt = _pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for attn in MODELS:
        pts = sorted((r["T"], r["ms"]) for r in results["prefill"] if r["attn"] == attn and r.get("ms"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=attn)
    ax.set(xscale="log", yscale="log", xlabel="prompt length T (tokens)", ylabel="prefill time (ms)",
           title=f"Prefill latency, batch {results['args']['batch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def save_decode_plot(results, path):
    """Decode, per (ctx, batch): tokens/s of every model and variant (bars, log y; hatched: naive),
    Orthros / Transformer for each variant (a dashed line at 0.95), and the fast variants'
    fraction of the HBM-bandwidth limit."""
    plt = _pyplot(path)
    if plt is None:
        return
    recs = results["decode"]
    groups = sorted(dict.fromkeys((r["ctx"], r["batch"]) for r in recs))
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    get = {(r["attn"], r["variant"], r["ctx"], r["batch"]): r for r in recs}
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.8 * len(groups) + 3), 11), sharex=True)
    width = 0.8 / (len(MODELS) * len(variants))
    for i, (attn, v) in enumerate((a, v) for a in MODELS for v in variants):
        xs = [g + (i + 0.5) * width - 0.4 for g in range(len(groups))]
        ys = [get.get((attn, v) + grp, {}).get("tokens_per_s") or 0 for grp in groups]
        axes[0].bar(xs, ys, width, color=f"C{MODELS.index(attn)}", alpha=1 - 0.6 * variants.index(v) / max(1, len(variants)),
                    hatch="//" if v.startswith("naive") else None, label=f"{attn}, {v}")
    axes[0].set(yscale="log", ylabel="tokens/s", title="Decode speed (hatched: naive KV cache)")
    axes[0].legend(fontsize=6, ncol=3)
    for j, v in enumerate(variants):
        xs = [g + (j + 0.5) * 0.8 / len(variants) - 0.4 for g in range(len(groups))]
        ratio = [(get.get(("orthros", v) + grp, {}).get("tokens_per_s") or float("nan")) /
                 (get.get(("transformer", v) + grp, {}).get("tokens_per_s") or float("nan")) for grp in groups]
        axes[1].plot(xs, ratio, "o", color=f"C{j}", label=v)
        if v.startswith("fast"):
            for attn, marker in (("transformer", "s"), ("orthros", "o")):
                hbm = [get.get((attn, v) + grp, {}).get("hbm_fraction") or float("nan") for grp in groups]
                axes[2].plot(xs, hbm, marker, color=f"C{j}", label=f"{attn}, {v}")
    axes[1].axhline(0.95, color="gray", ls="--", lw=1)
    axes[1].set(ylabel="orthros / transformer", title="Orthros / Transformer, tokens/s (dashed: 0.95)")
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].set(ylabel="fraction of HBM limit", ylim=(0, 1), title="Fast decoder: fraction of the HBM-bandwidth limit")
    axes[2].legend(fontsize=6, ncol=2)
    axes[2].set_xticks(range(len(groups)), [f"{c // 1024}K x {b}" if c >= 1024 else f"{c} x {b}" for c, b in groups])
    axes[2].set_xlabel("context x batch")
    for ax in axes:
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# -----------------------------------------------------------------------------

def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weight dtype for prefill and decode (training always uses fp32 weights + bf16 autocast)")
    p.add_argument("--n_layer", type=int, default=12, help="layers")
    p.add_argument("--n_embd", type=int, default=768, help="model width C")
    p.add_argument("--n_head", type=int, default=6, help="heads (head dim = n_embd / n_head)")
    p.add_argument("--vocab_size", type=int, default=50304, help="vocabulary size")
    p.add_argument("--window", type=int, default=128, help="sliding window w (orthros and swa)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the prefill section")
    p.add_argument("--prefill_lens", default="8192,16384,32768,65536,131072,262144,524288,1048576,2097152",
                   help="comma-separated prompt lengths (those that do not fit in memory are recorded as OOM)")
    p.add_argument("--long_T", type=int, default=262144, help="prompts longer than this run --long_reps times after --long_warmup warm-ups")
    p.add_argument("--long_reps", type=int, default=1, help="timed repetitions for prompts longer than --long_T")
    p.add_argument("--long_warmup", type=int, default=0,
                   help="warm-up calls for prompts longer than --long_T (the shorter lengths have already warmed the kernels)")
    p.add_argument("--decode_ctx", default="4096,32768,131072", help="comma-separated context lengths for decoding")
    p.add_argument("--decode_batches", default="1,8", help="comma-separated decode batch sizes")
    p.add_argument("--decode_steps", type=int, default=50, help="timed decode steps per run")
    p.add_argument("--decode_reps", type=int, default=3, help="interleaved rounds: runs per (model, variant, ctx, batch); the median is reported")
    p.add_argument("--decode_variants", default=",".join(DECODE_VARIANTS),
                   help="comma-separated decoders to time: naive, naive+compile (compile_blocks), fast, fast+compile "
                        "(FastDecoder(compile=True))")
    p.add_argument("--kernel_options", type=json.loads, default=None,
                   help="FlexAttention's kernel_options for the fast decoder, as JSON, e.g. '{\"num_stages\": 2}' "
                        "(default: engine.kernel_split's)")
    p.add_argument("--profile", action="store_true", help="also profile 20 steps of each fast decoder's kernels")
    p.add_argument("--gptfast", help="a folder with gpt-fast's model.py: time its decode loop beside ours")
    p.add_argument("--decode_cache", default="prefill", choices=["prefill", "random"],
                   help="where each round's prompt cache comes from: model.prefill of a random prompt, or random keys "
                        "and values (no prefill: a Transformer prefill of 128K x 8 takes seconds); shared by every "
                        "decoder of the round either way")
    p.add_argument("--time_budget", type=float, default=0,
                   help="seconds (from the start): the decode section starts no round after the first of a (ctx, batch) "
                        "that would end past it (by its fastest round so far); 0 = no limit. Rounds run outermost and "
                        "the first always runs whole, so every setting gets at least one round")
    p.add_argument("--hbm_tbps", type=float, default=4.8, help="HBM bandwidth in TB/s for hbm_fraction (H200: 4.8)")
    p.add_argument("--train_T", type=int, default=2048, help="training sequence length")
    p.add_argument("--train_batch", type=int, default=8, help="training batch size")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median) for prefill and training")
    p.add_argument("--warmup", type=int, default=2, help="untimed warmup calls before each timing")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="peak bf16 dense TFLOP/s for MFU (H100/H200: 989)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated models to run (every section)")
    p.add_argument("--sections", default="prefill,decode,train", help="comma-separated subset of prefill,decode,train")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block of every model (compile_blocks(model)) in the prefill and train "
                        "sections (the decode section runs each of --decode_variants, eager and compiled)")
    p.add_argument("--out", help="write the JSON here, and the plots beside it (<stem>_prefill.png, <stem>_decode.png), "
                                 "unless --out_png / --out_decode_png say otherwise")
    p.add_argument("--out_json", default="bench_results.json", help="where to write every figure")
    p.add_argument("--out_png", default="bench_prefill.png", help="prefill plot (needs matplotlib); '' for none")
    p.add_argument("--out_decode_png", default="bench_decode.png", help="decode plot (needs matplotlib); '' for none")
    p.add_argument("--tiny", action="store_true", help="small preset for a CPU smoke run: " + str(TINY))
    args, _ = p.parse_known_args(argv)
    if args.tiny:
        p.set_defaults(**TINY)  # flags given explicitly still win over the preset
    args = p.parse_args(argv)
    args.prefill_lens, args.decode_ctx, args.decode_batches = map(ints, (args.prefill_lens, args.decode_ctx, args.decode_batches))
    args.sections = [s for s in args.sections.split(",") if s]
    args.decode_variants = [v for v in args.decode_variants.split(",") if v]
    if not args.decode_variants or set(args.decode_variants) - set(DECODE_VARIANTS):
        p.error(f"--decode_variants takes a comma-separated subset of {','.join(DECODE_VARIANTS)}, got {','.join(args.decode_variants)!r}")
    if args.kernel_options is not None and not isinstance(args.kernel_options, dict):
        p.error(f"--kernel_options takes a JSON object, e.g. '{{\"num_stages\": 2}}', got {args.kernel_options!r}")
    if args.out:
        stem = str(Path(args.out).with_suffix(""))
        explicit = lambda flag: any(a == flag or a.startswith(flag + "=") for a in (argv if argv is not None else sys.argv[1:]))
        args.out_json = args.out
        if not explicit("--out_png"):
            args.out_png = stem + "_prefill.png"
        if not explicit("--out_decode_png"):
            args.out_decode_png = stem + "_decode.png"
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - set(MODELS):
        p.error(f"--models takes a comma-separated subset of {','.join(MODELS)}, got {','.join(args.models)!r}")
    if min([args.reps, args.long_reps, args.decode_steps, args.decode_reps, args.batch, args.train_batch, args.train_T]
           + args.prefill_lens + args.decode_ctx + args.decode_batches) < 1 or min(args.warmup, args.long_warmup) < 0:
        p.error("lengths, batch sizes, --reps, --long_reps, --decode_steps and --decode_reps must be >= 1, "
                "--warmup and --long_warmup >= 0")
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(str(e))
    unknown = set(args.sections) - {"prefill", "decode", "train"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}: choose from prefill,decode,train")
    return args


def main(argv=None):
    t_main = time.time()
    args = parse_args(argv)
    args.t_start = t_main  # --time_budget counts from here
    device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype)
    # Long enough for every prompt, every decode run (prompt + warmup + timed steps), and training.
    args.max_seq_len = max(args.prefill_lens + [c + args.warmup + args.decode_steps + 1 for c in args.decode_ctx] + [args.train_T])
    torch.set_float32_matmul_precision("high")
    if args.compile or any(v.endswith("+compile") for v in args.decode_variants):
        # three models x prefill/decode/train shapes: more graphs than the default limit of 8
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    results = {
        "meta": run_meta(device),
        "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items()},
        "prefill": [], "prefill_speedup": [], "decode": [], "train": [],
    }

    def save():  # atomic: a run killed mid-write keeps the last good JSON
        atomic_write(args.out_json, lambda f: json.dump(results, f, indent=1), mode="w")

    print(f"{results['meta']}\nmodel: {args.n_layer} layers, n_embd={args.n_embd}, {args.n_head} heads, window={args.window}, "
          f"vocab={args.vocab_size}, {args.dtype}; sections {args.sections}", flush=True)
    t_start = time.time()
    for name, fn in (("prefill", bench_prefill), ("decode", bench_decode), ("train", bench_train)):
        if name in args.sections:
            try:
                fn(args, device, results, save)
            except Exception:  # keep what was measured, and go on to the next section
                traceback.print_exc()
                print(f"NOTE: the {name} section stopped on the error above", flush=True)
                free_memory(device)
            print(f"-- {name} done at {time.time() - t_start:.0f} s", flush=True)
            print_tables(results, [name])
    print("\n==== summary ====")
    print_tables(results)
    save()
    print(f"\nwrote {args.out_json}", flush=True)
    if args.out_png and results["prefill"]:
        save_prefill_plot(results, args.out_png)
    if args.out_decode_png and results["decode"]:
        save_decode_plot(results, args.out_decode_png)
    return results


if __name__ == "__main__":
    main()
