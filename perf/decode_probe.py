"""
Inside a decode step, on one GPU: what perf/bench.py's tokens/s cannot show. Sections (--sections),
run in this order, each figure written to <out>/probe.json as it comes (and printed, and kept in
<out>/probe.txt), so that a run cut short keeps what it measured:
  naive    orthros.py's naive decoder (what sample.py runs), eager, Orthros and the Transformer at
           4K x 1 and 32K x 8: ms per step, and torch.profiler over a few steps: CPU time, kernel
           time and kernel launches per step, the ops with the most CPU time, the longest kernels
  profile  FastDecoder(compile=True) steps without CUDA graphs under torch.profiler, Orthros and the
           Transformer at 4K x 1, 32K x 8, 128K x 1, 128K x 8: kernels and kernel time per step
  sdpa     the decoder's fused attention (one FlexAttention call per layer, all layers in one CUDA
           graph) against scaled_dot_product_attention on the same shapes, per SDPA backend: the
           Transformer's one call, Orthros's two (the output twin over the prefix, the base twin
           over its window, as orthros.py decodes) and one with a mask for both twins
  sweep    FlexAttention's kernel_options one at a time (block size, warps, stages, the KV split,
           ...): per option the attention's time per layer and its fraction of the HBM limit, and
           its largest difference from the default options' output; an option the kernel rejects
           is recorded with its error
The attention timings read (B, H, rows, D) caches of rows = the longest context + 64, one per
layer (no cache fits in L2), at contexts of --ctx, as FastDecoder reads them in perf/bench.py.

    python perf/decode_probe.py --out out/probe --time_budget 480      # one H200
    python perf/decode_probe.py --sections sweep --sweep '[{}, {"num_stages": 2}]' --sweep_kinds orthros
    python perf/decode_probe.py --tiny --device cpu --out /tmp/probe    # a CPU smoke run of every line
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: import from the repository root
from data.prepare_utils import atomic_write
from orthros import KVCache, Orthros, OrthrosConfig, in_window
from perf.engine import BLOCK, FastDecoder, compiled_flex_attention, decode_block_mask

KINDS = {"orthros": 2, "transformer": 1}  # the models compared, and their query rows per token
TINY = dict(n_layer=2, n_embd=64, n_head=2, window=16, vocab_size=512, ctx="256,512", batches="1,2",
            naive_settings="256x1,512x2", steps=3, reps=3)
# FlexAttention's decode kernel on a GPU: BLOCK_N 64, 2 warps, 1 stage, SPLIT_KV = 2 * SMs // (B * H_kv) by
# default; "xF" scales that split by F. Each option (and batch, and model) compiles a kernel of its own.
SWEEP = [{}, {"SPLIT_KV": "x2"}, {"SPLIT_KV": "x4"}, {"num_stages": 2}, {"num_stages": 3}, {"num_warps": 4},
         {"BLOCK_N": 128}, {"num_warps": 4, "num_stages": 3}, {"SPLIT_KV": "x0.5"}, {"num_warps": 8}, {"BLOCK_N": 32},
         {"ROWS_GUARANTEED_SAFE": True}, {"BLOCKS_ARE_CONTIGUOUS": True}, {"PRESCALE_QK": True}, {"USE_TMA": True}]


class Probe:
    """The output: records per section, the JSON rewritten after each, every line printed and logged."""

    def __init__(self, args):
        self.args, self.t0, self.out = args, time.time(), Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.out / "probe.txt", "w")
        commit = os.environ.get("ORTHROS_GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        device = torch.device(args.device)
        self.results = {"meta": {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                 "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": commit or None},
                        "args": {k: v for k, v in vars(args).items()}, "skipped": []}

    def log(self, line):
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def add(self, section, rec):
        self.results.setdefault(section, []).append(rec)
        atomic_write(self.out / "probe.json", lambda f: json.dump(self.results, f, indent=1, default=str), mode="w")

    def time_left(self, what):
        """False, and the measurement listed as skipped, once --time_budget has run out."""
        if self.args.time_budget and time.time() - self.t0 > self.args.time_budget:
            self.results["skipped"].append(what)
            return False
        return True


def measure(probe, section, rec, fn):
    """rec + fn()'s figures, or the error (printed, recorded: one failure costs one figure)."""
    try:
        rec.update(fn())
        rec["status"] = "ok"
    except Exception as e:  # an option or backend the kernel rejects, an OOM: record it and go on
        traceback.print_exc()
        rec["status"] = f"error: {type(e).__name__}: {e}"[:400]
    probe.add(section, rec)
    return rec


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_ms(step, warmup, steps, device):
    """Milliseconds per call of step, eager, over `steps` calls after `warmup` calls."""
    for _ in range(warmup):
        step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return 1e3 * (time.perf_counter() - t) / steps


def timer(fn, device, reps):
    """A function of no arguments giving the median seconds per call of fn over 3 x reps calls:
    replayed as one CUDA graph on a GPU (after a warm-up call outside it: compilation), else eager."""
    fn()
    if device.type != "cuda":
        def run():
            times = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append((time.perf_counter() - t) / reps)
            return statistics.median(times)
        return run
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def run():
        graph.replay()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        return statistics.median(times)
    return run


def kernel_summary(prof, steps, top=15):
    """Per step: kernel launches, kernel time (us), and the top kernels by time, from the profiler's
    device events; and the profiler's own table sorted by device time, as a fallback."""
    kernels = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            n, us = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, us + e.time_range.elapsed_us())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    out = {"kernels_per_step": sum(n for n, _ in kernels.values()) / steps,
           "kernel_us_per_step": sum(us for _, us in kernels.values()) / steps,
           "top_kernels": [(name[:110], n / steps, us / steps) for name, (n, us) in ranked[:top]]}
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            out["table"] = prof.key_averages().table(sort_by=key, row_limit=top)
            break
        except Exception:
            continue
    return out


def profiled(fn, steps, device):
    """torch.profiler over `steps` calls of fn (CPU and, on a GPU, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    return prof


def make_model(args, attn, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = Orthros(OrthrosConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                                      n_embd=args.n_embd, window=args.window, attn=attn, max_seq_len=args.rows))
    return model.to(args.dtype).eval()


def log_kernels(probe, rec):
    probe.log(f"  {rec['kernels_per_step']:.0f} kernels/step, {rec['kernel_us_per_step']:.0f} us kernel time/step")
    for name, n, us in rec["top_kernels"][:10]:
        probe.log(f"    {n:6.1f} x {us:9.1f} us  {name}")


# -- Sections ------------------------------------------------------------------------------

def naive_section(probe, args, device):
    """orthros.py's decode, eager, from a random cache of ctx positions (as perf/bench.py's --decode_cache random)."""
    for ctx, B in args.naive_settings:
        for attn in KINDS:
            if not probe.time_left(f"naive {attn} {ctx}x{B}"):
                return
            def run():
                model = make_model(args, attn, device)
                cfg = model.config
                cache = KVCache(model, B)
                for layer in cache.layers:
                    layer.k, layer.v = (torch.randn(B, cfg.n_head, ctx, cfg.n_embd // cfg.n_head, device=device,
                                                    dtype=args.dtype) for _ in range(2))
                cache.length = ctx
                token = torch.zeros(B, 1, dtype=torch.long, device=device)
                step = lambda: model.decode(token, cache)
                ms = eager_ms(step, 2, args.steps, device)
                prof = profiled(step, args.steps, device)
                cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
                return {"ms_per_step": ms, "tokens_per_s": 1e3 * B / ms, **kernel_summary(prof, args.steps),
                        "cpu_us_per_step": sum(e.self_cpu_time_total for e in cpu) / args.steps,
                        "top_cpu_ops": [(e.key, e.count / args.steps, e.self_cpu_time_total / args.steps) for e in cpu[:15]]}
            rec = measure(probe, "naive", {"attn": attn, "ctx": ctx, "batch": B}, run)
            if rec["status"] == "ok":
                probe.log(f"naive {attn:>11} {ctx}x{B}: {rec['ms_per_step']:.2f} ms/step ({rec['tokens_per_s']:.0f} tok/s), "
                          f"{rec['cpu_us_per_step']:.0f} us CPU (self)/step")
                log_kernels(probe, rec)
                for key, n, us in rec["top_cpu_ops"][:10]:
                    probe.log(f"    {n:6.1f} x {us:9.1f} us CPU  {key}")
            else:
                probe.log(f"naive {attn} {ctx}x{B}: {rec['status']}")


def profile_section(probe, args, device):
    """FastDecoder(compile=True, cuda_graphs=False): the kernels of one step, under torch.profiler."""
    for B in args.batches:
        for attn in KINDS:
            if not probe.time_left(f"profile {attn} B={B}"):
                return
            try:
                model = make_model(args, attn, device)
                fast = FastDecoder(model, B, max_len=args.rows, compile=True, cuda_graphs=False)
                for k, v in zip(fast.cache.k, fast.cache.v):
                    k.normal_(), v.normal_()
            except Exception as e:
                probe.add("profile", {"attn": attn, "batch": B, "status": f"error: {type(e).__name__}: {e}"[:400]})
                continue
            token = torch.zeros(B, 1, dtype=torch.long, device=device)
            for ctx in args.ctx:
                def run():
                    def step():
                        fast.cache.length = ctx   # every step at position ctx: the same work each time
                        fast.decode(token, fast.cache)
                    return {"ms_per_step_eager": eager_ms(step, 3, args.steps, device),
                            **kernel_summary(profiled(step, args.steps, device), args.steps)}
                rec = measure(probe, "profile", {"attn": attn, "ctx": ctx, "batch": B}, run)
                probe.log(f"profile fast+compile {attn:>11} {ctx}x{B}: {rec['status']}")
                if rec["status"] == "ok":
                    log_kernels(probe, rec)
            fast = model = None


def attention_caches(args, B, device):
    """Random K, V (B, H, rows, D) per layer: the same ones at every call (seeded)."""
    torch.manual_seed(1)
    shape = (B, args.n_head, args.rows, args.n_embd // args.n_head)
    return [(torch.randn(shape, device=device, dtype=args.dtype), torch.randn(shape, device=device, dtype=args.dtype))
            for _ in range(args.n_layer)]


def flex_layers(args, attn, B, caches, kernel_options, device):
    """(pos, fn): fn runs the fused attention of every layer at position pos[0], as FastDecoder does."""
    L, D = KINDS[attn], args.n_embd // args.n_head
    torch.manual_seed(2)   # the same queries for every option
    q = torch.randn(B, args.n_head, L, D, device=device, dtype=args.dtype)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    mask, refresh = decode_block_mask(pos, (args.window, None) if attn == "orthros" else (None,), args.rows)
    outs = []

    def fn():
        refresh()
        outs[:] = [compiled_flex_attention(q, k, v, block_mask=mask, kernel_options=kernel_options) for k, v in caches]
    return pos, fn, outs


def hbm(args, B, ctx, sec):
    """Per layer call: us, and the fraction of the HBM limit (its K, V bytes of ctx + 1 keys / time / bandwidth)."""
    kv_bytes = 2 * B * args.n_embd * (ctx + 1) * torch.finfo(args.dtype).bits // 8
    return {"us_per_layer": 1e6 * sec / args.n_layer, "hbm_fraction": args.n_layer * kv_bytes / sec / (args.hbm_tbps * 1e12)}


def sdpa_section(probe, args, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"default": None, **{name.lower(): getattr(SDPBackend, name) for name in
                                    ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION") if hasattr(SDPBackend, name)}}
    for B in args.batches:
        caches = attention_caches(args, B, device)
        D = args.n_embd // args.n_head
        for attn in KINDS:
            pos, fn, _ = flex_layers(args, attn, B, caches, None, device)
            run = None
            for ctx in args.ctx:
                if not probe.time_left(f"sdpa flex {attn} {ctx}x{B}"):
                    return
                def flex():
                    nonlocal run
                    pos.fill_(ctx)
                    run = run or timer(fn, device, args.reps)
                    return hbm(args, B, ctx, run())
                rec = measure(probe, "sdpa", {"attn": attn, "ctx": ctx, "batch": B, "kernel": "flex_attention"}, flex)
                probe.log(f"attention {attn:>11} {ctx}x{B} flex_attention: " + fmt(rec))
        for ctx in args.ctx:
            n, w = ctx + 1, min(args.window, ctx + 1)
            q = torch.randn(B, args.n_head, 1, D, device=device, dtype=args.dtype)
            both = torch.randn(B, args.n_head, 2, D, device=device, dtype=args.dtype)
            keys = torch.arange(n, device=device)
            mask = torch.stack([in_window(ctx, keys, args.window), in_window(ctx, keys, None)])   # (2, n)
            calls = {  # per layer: the Transformer's call, Orthros's two as orthros.py makes them, Orthros masked
                ("transformer", "one call"): lambda k, v: F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n]),
                ("orthros", "two calls"): lambda k, v: (F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n]),
                                                        F.scaled_dot_product_attention(q, k[:, :, n - w:n], v[:, :, n - w:n])),
                ("orthros", "one masked call"): lambda k, v: F.scaled_dot_product_attention(both, k[:, :, :n], v[:, :, :n],
                                                                                            attn_mask=mask)}
            for (attn, how), call in calls.items():
                for name, backend in backends.items():
                    if not probe.time_left(f"sdpa {attn} {how} {name} {ctx}x{B}"):
                        return
                    def sdpa():
                        def fn():
                            if backend is None:
                                return [call(k, v) for k, v in caches]
                            with sdpa_kernel([backend]):
                                return [call(k, v) for k, v in caches]
                        return hbm(args, B, ctx, timer(fn, device, args.reps)())
                    rec = measure(probe, "sdpa", {"attn": attn, "ctx": ctx, "batch": B, "kernel": f"sdpa {how}",
                                                  "backend": name}, sdpa)
                    probe.log(f"attention {attn:>11} {ctx}x{B} sdpa {how}, {name}: " + fmt(rec))
        caches = None


def fmt(rec):
    if rec["status"] != "ok":
        return rec["status"].split("\n")[0][:200]
    return f"{rec['us_per_layer']:.1f} us/layer [{rec['hbm_fraction']:.0%} of HBM]"


def sweep_section(probe, args, device):
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else os.cpu_count()
    default_out = {}
    for options in args.sweep:
        for B in args.sweep_batches:
            caches = attention_caches(args, B, device)
            split = max(sms // (B * args.n_head) * 2, 1)   # FlexAttention's default KV split on a GPU
            opts = {k: max(1, int(split * float(v[1:]))) if k == "SPLIT_KV" else v for k, v in options.items()}
            for attn in args.sweep_kinds:
                pos, fn, outs = flex_layers(args, attn, B, caches, opts or None, device)
                run = None
                for ctx in args.ctx:
                    if not probe.time_left(f"sweep {options} {attn} {ctx}x{B}"):
                        return
                    def one():
                        nonlocal run
                        pos.fill_(ctx)
                        run = run or timer(fn, device, args.reps)   # the first call compiles, then the graph
                        rec = hbm(args, B, ctx, run())
                        out = outs[-1].float()                      # the last layer's, at ctx
                        if not options:
                            default_out[attn, B, ctx] = out.clone()
                        elif (attn, B, ctx) in default_out:
                            rec["max_abs_diff_from_default"] = (out - default_out[attn, B, ctx]).abs().max().item()
                        return rec
                    rec = measure(probe, "sweep", {"options": options, "kernel_options": opts, "attn": attn, "ctx": ctx,
                                                   "batch": B}, one)
                    probe.log(f"sweep {json.dumps(opts) or '{}'} {attn:>11} {ctx}x{B}: " + fmt(rec)
                              + (f" (max diff {rec['max_abs_diff_from_default']:.2g})" if "max_abs_diff_from_default" in rec else ""))
                    if rec["status"] != "ok":
                        break   # rejected: its other contexts would be too
            caches = None


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out/probe"), help="folder for probe.json and probe.txt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sections", default="naive,profile,sdpa,sweep")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--ctx", default="4096,32768,131072", help="contexts of the profile, sdpa and sweep sections")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--sweep", type=json.loads, default=SWEEP, help="the sweep's kernel_options, a JSON list")
    p.add_argument("--sweep_batches", default=None, help="the sweep's batch sizes (default: --batches)")
    p.add_argument("--sweep_kinds", default=",".join(KINDS), help="the sweep's models")
    p.add_argument("--naive_settings", default="4096x1,32768x8", help="ctx x batch of the naive section")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed and profiled")
    p.add_argument("--reps", type=int, default=30, help="graph replays per timing (3 timings, median)")
    p.add_argument("--hbm_tbps", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--time_budget", type=float, default=0, help="seconds: start no measurement after this (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run: " + str(TINY))
    args, _ = p.parse_known_args(argv)
    if args.tiny:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    args.ctx, args.batches = ints(args.ctx), ints(args.batches)
    args.sweep_batches = ints(args.sweep_batches) if args.sweep_batches else args.batches
    args.sweep_kinds = [k for k in args.sweep_kinds.split(",") if k]
    if set(args.sweep_kinds) - set(KINDS) or not isinstance(args.sweep, list):
        p.error(f"--sweep_kinds takes a subset of {','.join(KINDS)}; --sweep a JSON list of kernel_options objects")
    args.naive_settings = [tuple(int(x) for x in s.split("x")) for s in args.naive_settings.split(",") if s]
    args.sections = [s for s in args.sections.split(",") if s]
    if set(args.sections) - {"naive", "profile", "sdpa", "sweep"}:
        p.error(f"unknown sections in {args.sections}: choose from naive,profile,sdpa,sweep")
    args.rows = -(-(max(args.ctx + [c for c, _ in args.naive_settings]) + 64) // BLOCK) * BLOCK
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return args


def main(argv=None):
    args = parse_args(argv)
    torch._dynamo.config.recompile_limit = 1024            # a graph per (model, batch, option)
    torch._dynamo.config.accumulated_recompile_limit = 65536
    probe, device = Probe(args), torch.device(args.device)
    probe.log(f"{probe.results['meta']}\n{args.n_layer} layers, n_embd={args.n_embd}, {args.n_head} heads, window "
              f"{args.window}, {args.dtype}, cache rows {args.rows}; sections {args.sections}")
    sections = {"naive": naive_section, "profile": profile_section, "sdpa": sdpa_section, "sweep": sweep_section}
    with torch.inference_mode():
        for name in args.sections:
            t = time.time()
            try:
                sections[name](probe, args, device)
            except Exception:  # keep what was measured, go on to the next section
                probe.log(traceback.format_exc())
            probe.log(f"-- {name}: {time.time() - t:.0f} s (total {time.time() - probe.t0:.0f} s)")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    probe.add("done", {"seconds": time.time() - probe.t0})
    probe.log(f"wrote {probe.out / 'probe.json'}; skipped for time: {len(probe.results['skipped'])}")


if __name__ == "__main__":
    main()
