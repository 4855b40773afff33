"""
Benchmark Orthros against the Transformer and SWA baselines at one model size, in one process.

Sections (pick with --sections):
  prefill  latency of model.prefill(idx) at --batch (1) for each T in --prefill_lens, the speedup
           over the Transformer, and the FLOP-count limit of that speedup (prefill_flop_limits)
  decode   tokens/s of model.decode() with the KV cache after a prompt of each --decode_ctx
  train    forward + backward + AdamW step at --train_T: ms, tokens/s and MFU
Every measurement also records the peak GPU memory. Results are printed as they come, and the
JSON file is rewritten after every measurement, so a run cut short by a timeout keeps its figures.

    python bench.py                           # the paper size on a GPU (12 layers, d=768, w=128)
    python bench.py --tiny --device cpu       # a CPU smoke run of every line, < 1 minute
    python bench.py --sections prefill --prefill_lens 8192,32768
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import time
import traceback

import torch

from orthros import Orthros, OrthrosConfig

MODELS = ("transformer", "orthros", "swa")  # the Transformer first: the others' speedups need it
TINY = dict(n_layer=2, n_embd=128, n_head=2, window=16, vocab_size=4096, prefill_lens="256,512,1024",
            decode_ctx="128", decode_steps=8, train_T=256, train_batch=2, reps=3)


# -----------------------------------------------------------------------------
# FLOP counts. One multiply-add = 2 FLOPs. Norms, RoPE, softmax, GELU and the embedding lookup
# are left out: they are a few percent at this size.

def attended_pairs(T, window=None, n_q=None):
    """Number of (query, key) pairs a causal attention over T positions computes, for its last
    n_q queries (default all T), each seeing at most `window` keys (None = all keys <= itself)."""
    n_q = T if n_q is None else n_q
    if window is None:  # query at position t sees t + 1 keys, for t = T - n_q .. T - 1
        return n_q * T - n_q * (n_q - 1) // 2
    assert n_q == T, "windowed attention runs over whole sequences"
    w = min(window, T)  # the first w queries see 1, 2, ..., w keys; every later one sees w
    return w * (w + 1) // 2 + (T - w) * window


def forward_flops(cfg, T, t_out, lm_head_tokens=None):
    """FLOPs of one forward over one sequence of T tokens whose last t_out are output positions
    (pre-training t_out = T, prefill t_out = 1), for cfg.attn. Per layer:
      token-wise: W_Q, W_O (2C^2) and the MLP (8C^2) on every token that flows through the
        layer (Orthros: T base + t_out output tokens), W_K, W_V (2C^2) on the T base tokens only;
      attention: QK^T and PV, 2 * 2 * C FLOPs per (query, key) pair (C = n_head * head_dim);
        Transformer: causal, T(T+1)/2 pairs; SWA and Orthros's base tokens: <= w keys per query;
        Orthros's output tokens: full causal cross-attention of its t_out queries.
    Plus the LM head, 2 C V per position with logits (t_out of them: prefill returns 1)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    orthros = cfg.attn == "orthros"
    n_tokens = T + t_out if orthros else T
    tokenwise = 2 * (10 * C * C * n_tokens + 2 * C * C * T)
    if cfg.attn == "transformer":
        pairs = attended_pairs(T)
    else:
        pairs = attended_pairs(T, cfg.window)
        if orthros:
            pairs += attended_pairs(T, None, n_q=t_out)
    lm_head = 2 * C * V * (t_out if lm_head_tokens is None else lm_head_tokens)
    return L * (tokenwise + 4 * C * pairs) + lm_head


def prefill_flop_limits(cfg, T, attn):
    """The best prefill speedup over the Transformer that FLOP counts allow: FLOPs(Transformer) /
    FLOPs(attn), both prefilling T tokens with logits at the last one only. Also returned: the
    same ratio with the LM head counted on all T tokens ("2 x params per token", tied embedding).
    NOTE: at the default size (12 x 768, w=128, V=50304) the first gives 4.4x / 14.8x / 28.6x at
    32K / 128K / 256K. METHOD.md quotes 3.4x / 10.6x / 20x: the second convention reproduces
    those (3.38x / 10.57x / 20.16x). prefill() only runs the LM head at the last position, so
    the first is the true limit for this code; the second is the more conservative figure."""
    ref, mine = dataclasses.replace(cfg, attn="transformer"), dataclasses.replace(cfg, attn=attn)
    exact = forward_flops(ref, T, 1) / forward_flops(mine, T, 1)
    all_tokens = forward_flops(ref, T, 1, lm_head_tokens=T) / forward_flops(mine, T, 1, lm_head_tokens=T)
    return exact, all_tokens


def train_flops(cfg, T, batch):
    """FLOPs of one training step: forward (pre-training, t_out = T) + backward (2x forward).
    Orthros's forward: token-wise work on 2T tokens (K, V on T), SWA for T base queries, causal
    cross-attention for T output queries (a Transformer's attention), LM head on T outputs."""
    return 3 * batch * forward_flops(cfg, T, T)


# -----------------------------------------------------------------------------
# Timing and memory helpers

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def build_model(args, attn, dtype, device):
    torch.manual_seed(0)
    with torch.device(device):  # initialize the weights on the device directly: much faster
        model = Orthros(make_config(args, attn))
    model = model.to(dtype)
    if args.compile:  # fuse each block's elementwise work; the warm-up calls absorb compile time
        model.compile_blocks()
    return model


def random_tokens(args, batch, T, device):
    return torch.randint(0, args.vocab_size, (batch, T), device=device)


# -----------------------------------------------------------------------------
# The three sections. Each appends records (dicts) to results[section] and calls save().

def bench_prefill(args, device, results, save):
    for attn in MODELS:
        model = build_model(args, attn, args.dtype, device).eval()
        oom_T = float("inf")  # the shortest prompt that ran out of memory
        for T in args.prefill_lens:
            rec = {"attn": attn, "T": T, "batch": args.batch}
            if T >= oom_T:  # a longer prompt cannot fit either: don't spend the time finding out
                rec["status"] = "OOM (skipped: a shorter T ran out of memory)"
            else:
                idx = random_tokens(args, args.batch, T, device)
                def run():
                    with torch.inference_mode():
                        return {"ms": 1e3 * time_fn(lambda: model.prefill(idx), device, args.reps, args.warmup)}
                rec.update(measure(run, device))
                if rec["status"] == "OOM":
                    oom_T = min(oom_T, T)
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


def bench_decode(args, device, results, save):
    for attn in MODELS:
        model = build_model(args, attn, args.dtype, device).eval()
        for ctx in args.decode_ctx:
            for B in args.decode_batches:
                def run():
                    with torch.inference_mode():
                        logits, cache = model.prefill(random_tokens(args, B, ctx, device))
                        next_idx = logits[:, -1].argmax(-1, keepdim=True)       # (B, 1)
                        if device.type == "cuda":  # the peak of the decode phase: cache + one step
                            torch.cuda.reset_peak_memory_stats(device)
                        for step in range(args.warmup + args.decode_steps):
                            if step == args.warmup:
                                sync(device)
                                t0 = time.perf_counter()
                            logits, cache = model.decode(next_idx, cache)
                            next_idx = logits[:, -1].argmax(-1, keepdim=True)   # greedy, as in serving
                        sync(device)
                        dt = time.perf_counter() - t0
                    return {"tokens_per_s": B * args.decode_steps / dt, "ms_per_step": 1e3 * dt / args.decode_steps}
                rec = {"attn": attn, "ctx": ctx, "batch": B, "steps": args.decode_steps, **measure(run, device)}
                results["decode"].append(rec)
                print(f"decode  {attn:>11} ctx={ctx:>6} B={B}: {fmt(rec, 'tokens_per_s', '{:.0f} tok/s')} "
                      f"{fmt(rec, 'ms_per_step', '{:.2f} ms/step')}  {fmt(rec, 'peak_mem_gb', '{:.2f} GB')}", flush=True)
                save()
        model = None  # free it before the next model
        free_memory(device)


def bench_train(args, device, results, save):
    T, B = args.train_T, args.train_batch
    for attn in MODELS:
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
            cells = [f"{fmt(rows[(a, s['T'])], 'ms', '{:.2f}'):>10} {fmt(rows[(a, s['T'])], 'peak_mem_gb', '({:.1f})'):>9}"
                     for a in MODELS]
            spd = [f"{fmt(s, f'{a}_speedup', '{:.2f}x'):>6} [{s[f'{a}_flop_limit']:.1f}; {s[f'{a}_flop_limit_lm_head_all_tokens']:.1f}]"
                   for a in ("orthros", "swa")]
            print(f"{s['T']:>7} | " + " | ".join(cells) + " | " + " | ".join(f"{c:>24}" for c in spd))
    if "decode" in sections and results["decode"]:
        print("\nDecode with the KV cache (tokens/s; peak GB during decoding)")
        print(f"{'ctx':>7} {'batch':>5} | " + " | ".join(f"{a:>20}" for a in MODELS))
        for ctx, B in dict.fromkeys((r["ctx"], r["batch"]) for r in results["decode"]):
            cells = [next((f"{fmt(r, 'tokens_per_s', '{:.0f}'):>10} {fmt(r, 'peak_mem_gb', '({:.1f})'):>9}"
                           for r in results["decode"] if (r["attn"], r["ctx"], r["batch"]) == (a, ctx, B)), "-")
                     for a in MODELS]
            print(f"{ctx:>7} {B:>5} | " + " | ".join(f"{c:>20}" for c in cells))
    if "train" in sections and results["train"]:
        print("\nTraining step (forward + backward + AdamW, bf16 autocast, fp32 weights)")
        print(f"{'model':>11} | {'T':>6} {'batch':>5} | {'ms/step':>9} {'tokens/s':>10} {'TFLOP/step':>10} {'MFU':>7} {'peak GB':>8} {'compiled':>8}")
        for r in results["train"]:
            tflop = f"{r['flops_per_step'] / 1e12:.3g}" if r.get("flops_per_step") else "-"
            print(f"{r['attn']:>11} | {r['T']:>6} {r['batch']:>5} | {fmt(r, 'ms', '{:.1f}'):>9} {fmt(r, 'tokens_per_s', '{:.0f}'):>10} "
                  f"{tflop:>10} {fmt(r, 'mfu', '{:.1%}'):>7} {fmt(r, 'peak_mem_gb', '{:.2f}'):>8} {fmt(r, 'compiled', '{}'):>8}")


def git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip() != ""
        return commit, dirty
    except Exception:
        return None, None


def save_plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"NOTE: matplotlib is not installed; no plot written to {path}", flush=True)
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
    print(f"wrote {path}", flush=True)


# -----------------------------------------------------------------------------

def parse_args():
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weight dtype for prefill and decode (training always uses fp32 weights + bf16 autocast)")
    p.add_argument("--n_layer", type=int, default=12, help="layers")
    p.add_argument("--n_embd", type=int, default=768, help="model width C")
    p.add_argument("--n_head", type=int, default=6, help="heads (head dim = n_embd / n_head)")
    p.add_argument("--vocab_size", type=int, default=50304, help="vocabulary size")
    p.add_argument("--window", type=int, default=128, help="sliding window w (orthros and swa)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the prefill section")
    p.add_argument("--prefill_lens", default="8192,16384,32768,65536,131072,262144", help="comma-separated prompt lengths")
    p.add_argument("--decode_ctx", default="4096,32768", help="comma-separated context lengths for decoding")
    p.add_argument("--decode_batches", default="1,8", help="comma-separated decode batch sizes")
    p.add_argument("--decode_steps", type=int, default=50, help="timed decode steps per (ctx, batch)")
    p.add_argument("--train_T", type=int, default=2048, help="training sequence length")
    p.add_argument("--train_batch", type=int, default=8, help="training batch size")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median) for prefill and training")
    p.add_argument("--warmup", type=int, default=2, help="untimed warmup calls before each timing")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="peak bf16 dense TFLOP/s for MFU (H100/H200: 989)")
    p.add_argument("--sections", default="prefill,decode,train", help="comma-separated subset of prefill,decode,train")
    p.add_argument("--compile", action="store_true", help="torch.compile every block of every model (model.compile_blocks()) in all sections")
    p.add_argument("--out_json", default="bench_results.json", help="where to write every figure")
    p.add_argument("--out_png", default="bench_prefill.png", help="prefill plot (needs matplotlib); '' for none")
    p.add_argument("--tiny", action="store_true", help="small preset for a CPU smoke run: " + str(TINY))
    args, _ = p.parse_known_args()
    if args.tiny:
        p.set_defaults(**TINY)  # flags given explicitly still win over the preset
    args = p.parse_args()
    args.prefill_lens, args.decode_ctx, args.decode_batches = map(ints, (args.prefill_lens, args.decode_ctx, args.decode_batches))
    args.sections = [s for s in args.sections.split(",") if s]
    if min([args.reps, args.decode_steps, args.batch, args.train_batch, args.train_T] + args.prefill_lens
           + args.decode_ctx + args.decode_batches) < 1 or args.warmup < 0:
        p.error("lengths, batch sizes, --reps and --decode_steps must be >= 1, --warmup >= 0")
    unknown = set(args.sections) - {"prefill", "decode", "train"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}: choose from prefill,decode,train")
    return args


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but CUDA is not available: use --device cpu")
    args.dtype = getattr(torch, args.dtype)
    # Long enough for every prompt, every decode run (prompt + warmup + timed steps), and training.
    args.max_seq_len = max(args.prefill_lens + [c + args.warmup + args.decode_steps for c in args.decode_ctx] + [args.train_T])
    torch.set_float32_matmul_precision("high")
    if args.compile:  # three models x prefill/decode/train shapes: more graphs than the default limit of 8
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    commit, dirty = git_commit()
    results = {
        "meta": {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": commit, "git_dirty": dirty},
        "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items()},
        "prefill": [], "prefill_speedup": [], "decode": [], "train": [],
    }

    def save():  # write to a temporary file first: a run killed mid-write keeps the last good JSON
        with open(args.out_json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.out_json + ".tmp", args.out_json)

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
        save_plot(results, args.out_png)


if __name__ == "__main__":
    main()
