"""
The paper's claims at classroom scale, through train.py and sample.py as a user runs them.

    python repro/experiments.py lm --seeds 3     # LM quality of the four models (Table 1, Fig. 2)
    python repro/experiments.py recall niah      # recall by distance, needles (Table 3, Fig. 3)
    python repro/experiments.py conversion --seeds 3   # Transformer -> Orthros vs. CPT (Table 2)
    python repro/experiments.py inference        # time to first token and decode speed (Table 4)
    python repro/experiments.py gap --seeds 3    # why Orthros trails at shakespeare_char
    python repro/experiments.py plots            # PNGs from the JSON files (needs matplotlib)
    python repro/experiments.py recall niah --scale cpu     # recall_tiny (window 32): CPU minutes
    python repro/experiments.py all --scale tiny --seeds 2  # every step, tiny: a smoke test

A step trains into out/exp-<scale>/ and writes results/<step>[_<scale>].json. The same command
again skips finished runs and resumes the others; --time_limit (or SIGTERM) stops them.
"""

import argparse
import itertools
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # python repro/experiments.py: import from the repository root
from checkpoint import ArgumentParser, load_checkpoint, model_from_checkpoint, pick_device, run_meta
from data.prepare_utils import atomic_write, ensure_prepared, load_meta
from data.recall.prepare import make_example
from data.sft import encode_example, exact_match
from data.tokenizer import get_tokenizer

RESULTS = Path("results")
FIRST_SEED = 1337  # train.py's default seed
LM_MODELS = {"transformer": "--attn transformer", "swa": "--attn swa", "orthros": "--attn orthros",
             "orthros_noso": "--attn orthros --scale_offset false"}
LM_COMPARISONS = [("orthros", "transformer"), ("orthros", "swa"), ("orthros", "orthros_noso")]
RECALL_MODELS = ("orthros", "transformer", "swa")
CONVERSION_ROWS = ("base_transformer", "c_orthros_untrained", "a_orthros_converted",
                   "b_transformer_cpt")
CONVERSION_COMPARISONS = [("a_orthros_converted", "b_transformer_cpt"),
                          ("a_orthros_converted", "c_orthros_untrained"),
                          ("c_orthros_untrained", "base_transformer")]
NIAH_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
GAP_TINY = dict(gap="--config shakespeare_char --n_layer 1 --n_head 2 --n_embd 32 --window 16 "
                    "--seq_len 32 --batch_size 4 --eval_interval 4 --eval_iters 2 --warmup_iters 2",
                gap_src="stdlib", gap_iters={"long": 8, "short": 4})
TINY_RUN = " --max_iters 30 --eval_interval 15 --eval_iters 2"
SCALES = {  # "gpu": minutes on one H200; "cpu": recall_tiny (window 32); "tiny": a smoke test
    "gpu": dict(lm="--config small --max_iters 1500", recall="--config recall", cont_frac=0.25,
                recall_data="recall", gap="--config shakespeare_char --eval_interval 100 "
                "--eval_iters 10", gap_src="data/torchsrc", gap_iters={"long": 800, "short": 600},
                niah_lens=[256, 512, 1024, 2048, 4096, 8192], niah_n=100, prompt_lens=[32768],
                new_tokens=128),
    "cpu": dict(lm="--config tiny", recall="--config recall_tiny", recall_data="recall_tiny",
                **GAP_TINY, cont_frac=0.25, niah_lens=[64, 128, 256, 300, 512, 1024], niah_n=40,
                prompt_lens=[4096], new_tokens=64),
    "tiny": dict(lm="--config tiny" + TINY_RUN, recall_data="recall_tiny", **GAP_TINY,
                 recall="--config recall_tiny" + TINY_RUN + " --eval_exact_match 20", cont_frac=0.5,
                 niah_lens=[64, 128], niah_n=4, prompt_lens=[512], new_tokens=8),
}


# -- Training runs: what each is, whether it has finished, running them -----------------------

@dataclass
class Run:
    """A train.py run: "--key", "value" pairs, its folder, whether it writes exact_match.json."""
    out_dir: Path
    args: list
    exact_match: bool = False

    @property
    def cmd(self):
        return [sys.executable, "train.py", *self.args, "--out_dir", str(self.out_dir)]

    @property
    def given(self):  # {key: value}; a key given twice keeps its last value, as in train.py
        return {k.removeprefix("--"): v for k, v in zip(self.args[::2], self.args[1::2])}

    @property
    def log(self):  # beside the run's folder
        return self.out_dir.with_name(self.out_dir.name + ".log")


def run_state(run):
    """'done', 'resume', 'overwrite' or 'fresh'; a folder of a run with other arguments: error."""
    results_written = not run.exact_match or (run.out_dir / "exact_match.json").exists()
    if (run.out_dir / "ckpt_last.pt").exists():
        ckpt = load_checkpoint(run.out_dir / "ckpt_last.pt")
        config = {**ckpt["train_config"], "config": ckpt.get("config_name")}
        differ = [f"--{k} {config[k]!r} there, {v!r} here" for k, v in run.given.items()
                  if k in config and k != "init_from" and str(config[k]).lower() != v.lower()]
        if differ:
            sys.exit(f"error: {run.out_dir} holds another run ({'; '.join(differ)}); "
                     "move it away, or delete it to train this one")
        done = ckpt["step"] >= ckpt["train_config"]["max_iters"] and results_written
        return "done" if done else "resume"
    evaluated = (run.out_dir / "log.jsonl").exists() and read_val_curve(run.out_dir)
    if run.given.get("max_iters") == "0" and results_written and evaluated:  # no checkpoint
        return "done"
    return "overwrite" if run.out_dir.is_dir() and any(run.out_dir.iterdir()) else "fresh"


Stop = type("Stop", (Exception,), {})  # (why, exit status): a failed run, SIGTERM, --time_limit


def run_all(jobs, parallel, deadline, keep_going=False, tick=None):
    """The (command, log path) jobs, `parallel` at a time; a failure (unless keep_going), SIGTERM or
    the deadline passes SIGTERM on (train.py saves ckpt_last.pt) and exits. tick(): every 0.5 s."""
    pending, running = list(jobs), []
    threads = (os.cpu_count() or 1) // max(1, min(parallel, len(jobs)))
    env = {"OMP_NUM_THREADS": str(max(1, threads)), **os.environ}

    def on_sigterm(signum, frame):
        raise Stop("SIGTERM", 3)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while pending or running:
            if deadline is not None and time.time() > deadline:
                raise Stop("--time_limit reached", 3)
            while pending and len(running) < parallel:
                cmd, log = pending.pop(0)
                print("$", shlex.join(cmd), flush=True)
                with open(log, "a") as f:  # appended: a resumed run keeps the earlier output
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
                running.append((proc, cmd, log))
            for proc, cmd, log in [job for job in running if job[0].poll() is not None]:
                running.remove((proc, cmd, log))
                if proc.returncode != 0:
                    tail = "".join(open(log, errors="replace").readlines()[-15:])
                    why = f"failed ({proc.returncode}): {shlex.join(cmd)}\n{tail}see {log}"
                    if not keep_going:
                        raise Stop(why, 1)
                    print(why, file=sys.stderr, flush=True)
            if tick is not None:
                tick()
            time.sleep(0.5)
    except Stop as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
        print(f"stopped: {stop.args[0]}", file=sys.stderr)
        running = [proc for proc, _, _ in running if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"{len(running)} trainings still running got SIGTERM (train.py saves ckpt_last.pt "
              "then); the same command continues every unfinished run.", file=sys.stderr)
        sys.exit(stop.args[1])
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(runs, S, **run_all_options):
    """Bring every run to its end: skip the finished, start, resume or restart the others."""
    runs, jobs = list(runs), []
    extra = {"resume": ["--init_from", "resume"], "overwrite": ["--overwrite", "true"], "fresh": []}
    for run in runs:
        if (state := run_state(run)) != "done":
            run.out_dir.parent.mkdir(parents=True, exist_ok=True)
            jobs.append(([*run.cmd, *extra[state]], run.log))
    print(f"{len(runs) - len(jobs)} of {len(runs)} runs already finished", flush=True)
    if not jobs:
        return
    t0 = time.time()
    run_all(jobs, S["parallel"] or len(jobs), S["deadline"], **run_all_options)
    print(f"{len(jobs)} runs finished in {time.time() - t0:.0f} s", flush=True)
    unfinished = [str(run.out_dir) for run in runs if run_state(run) != "done"]
    if unfinished:  # e.g. a training stopped by a signal that still exited with status 0
        sys.exit(f"error: these runs ended before their last step: {', '.join(unfinished)}; "
                 "run the same command again to continue them")


def read_evals(out_dir):
    """{step: evaluation record} of log.jsonl: a resumed step's later one, no line cut by a kill."""
    evals = {}
    for line in open(Path(out_dir) / "log.jsonl"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val_loss" in record:
            evals[record["step"]] = record
    return dict(sorted(evals.items()))


def read_val_curve(out_dir):
    return [(step, record["val_loss"]) for step, record in read_evals(out_dir).items()]


def read_json(path):
    return json.loads(Path(path).read_text())


def stats(values):
    """Per-seed values -> {"values", "mean", "std"}: the sample std, None for a single seed."""
    values = list(values)
    return {"values": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None}


def compare(a, b, a_stats, b_stats, metric):
    """Is a - b larger than the seeds' spread (std_a + std_b), and seed by seed?"""
    diff = a_stats["mean"] - b_stats["mean"]
    per_seed = [x - y for x, y in zip(a_stats["values"], b_stats["values"])]
    one_seed = a_stats["std"] is None or b_stats["std"] is None
    spread = None if one_seed else a_stats["std"] + b_stats["std"]
    same_sign = all(d > 0 for d in per_seed) or all(d < 0 for d in per_seed)
    return {"a": a, "b": b, "metric": metric, "diff_mean": diff, "rel_diff": diff / b_stats["mean"],
            "spread": spread, "larger_than_spread": None if one_seed else abs(diff) > spread,
            "per_seed_diffs": per_seed, "same_sign_every_seed": same_sign if per_seed[1:] else None}


def lm_runs(S, seeds, names=tuple(LM_MODELS)):
    return {(name, seed): Run(S["out"] / f"lm-{name}-seed{seed}",
                              f"{S['lm']} {LM_MODELS[name]} --seed {seed}".split())
            for name in names for seed in seeds}


def recall_runs(S, names=RECALL_MODELS):
    """The recall models, first seed only."""
    seed = S["seeds"][0]
    ensure_prepared(S["recall_data"])  # once, before the concurrent runs would each try
    return {attn: Run(S["out"] / f"recall-{attn}-seed{seed}",
                      f"{S['recall']} --attn {attn} --seed {seed}".split(), exact_match=True)
            for attn in names}


def save(name, obj, S, runs=()):
    """results/<name>.json at the GPU scale, results/<name>_<scale>.json below it."""
    path = RESULTS / (f"{name}.json" if S["name"] == "gpu" else f"{name}_{S['name']}.json")
    obj = {"meta": {**run_meta(pick_device()), "commands": [shlex.join(r.cmd) for r in runs]},
           **obj}
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1) + "\n"), mode="w")
    print(f"wrote {path}", flush=True)


def step_lm(S):
    """The four models on the default corpus, equal tokens: val-loss curves, final losses."""
    seeds = S["seeds"]
    ensure_prepared("stdlib")  # once, before the concurrent runs would each try
    runs = lm_runs(S, seeds)
    launch(runs.values(), S)
    out = {"seeds": seeds, "final_val_loss": {}, "best_val_loss": {}, "curves": {}}
    for name in LM_MODELS:
        curves = [read_val_curve(runs[name, s].out_dir) for s in seeds]
        steps = [step for step, _ in curves[0]]
        if any([step for step, _ in c] != steps for c in curves):
            sys.exit(f"error: the {name} runs evaluated at different steps; were they trained "
                     "with other arguments?")
        out["final_val_loss"][name] = stats(c[-1][1] for c in curves)
        out["best_val_loss"][name] = stats(min(v for _, v in c) for c in curves)
        by_step = [stats(c[i][1] for c in curves) for i in range(len(steps))]
        out["curves"][name] = {"steps": steps, "per_seed": [[v for _, v in c] for c in curves],
                               "mean": [s["mean"] for s in by_step],
                               "std": [s["std"] for s in by_step]}
    final = out["final_val_loss"]
    out["comparisons"] = [compare(a, b, final[a], final[b], "final_val_loss")
                          for a, b in LM_COMPARISONS]
    save("lm", out, S, runs.values())


def step_recall(S):
    """Recall by distance for the three models (window 128 at the GPU scale)."""
    runs = recall_runs(S)
    launch(runs.values(), S)
    accuracy = {attn: read_json(run.out_dir / "exact_match.json") for attn, run in runs.items()}
    window = load_checkpoint(runs["orthros"].out_dir / "ckpt_last.pt")["model_config"]["window"]
    save("recall", {"seed": S["seeds"][0], "window": window, "accuracy": accuracy}, S,
         runs.values())


def needle_distance(context_len, depth):
    """Tokens from the query back to the needle at depth (0: the context's start, 1: its end)."""
    # make_example's layout: the key at round(depth * (context_len - 2)), the query's at L + 1
    return context_len + 1 - round(depth * (context_len - 2))


def niah_examples(context_lens, depths, n_per_cell, task_params, tokenizer):
    """n_per_cell one-query recall examples per (context length, depth), bucket "L:depth"."""
    rng, examples = random.Random(0), []
    shape = {k: task_params[k] for k in ("n_pairs", "n_keys", "n_values")}
    for L, depth, _ in itertools.product(context_lens, depths, range(n_per_cell)):
        ex = make_example(rng, L, n_queries=1, first_distance=needle_distance(L, depth), **shape)
        tokens, mask = encode_example(ex["turns"], tokenizer)
        examples.append({"tokens": tokens, "mask": mask, "bucket": f"{L}:{depth}"})
    return examples


def niah_accuracy(ckpt, examples, max_len, device):
    """Exact match per bucket, greedy (bf16 on CUDA); blocked: flex would compile every length."""
    model = model_from_checkpoint(ckpt, max_seq_len=max_len, swa_impl="blocked").to(device).eval()

    @torch.no_grad()
    def generate(prompts, n):
        idx = torch.tensor(prompts, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            return model.generate(idx, n, temperature=0)[:, idx.size(1):].tolist()
    return exact_match(examples, generate)


def step_niah(S, depths=NIAH_DEPTHS):
    """Needle in a haystack for the recall models, inside the trained length and beyond it."""
    runs = recall_runs(S)
    launch(runs.values(), S)  # trains the recall models if the recall step has not
    lens, n, device = S["niah_lens"], S["niah_n"], pick_device()
    ckpts = {attn: load_checkpoint(run.out_dir / "ckpt_last.pt") for attn, run in runs.items()}
    orthros = ckpts["orthros"]
    task = load_meta(ensure_prepared(orthros["dataset"]))["params"]
    examples = niah_examples(lens, depths, n, task, get_tokenizer(orthros["tokenizer"]))
    accuracy, models = {}, {}
    for attn, ckpt in ckpts.items():
        t0 = time.time()
        scores = niah_accuracy(ckpt, examples, max(lens) + 8, device)
        accuracy[attn] = [[scores[f"{L}:{d}"]["accuracy"] for d in depths] for L in lens]
        mc = ckpt["model_config"]
        # reach: the farthest a stack of sliding windows sees; it bounds SWA, not Orthros
        models[attn] = {"ckpt": str(runs[attn].out_dir / "ckpt_last.pt"), "step": ckpt["step"],
                        "n_layer": mc["n_layer"], "window": mc["window"],
                        "reach": None if attn == "transformer" else mc["n_layer"] * mc["window"]}
        print(f"niah {attn}: {len(examples)} needles in {time.time() - t0:.0f} s", flush=True)
    save("niah", {"window": orthros["model_config"]["window"], "context_lens": list(lens),
                  "trained_context": task["context_len"], "depths": list(depths),
                  "trained_seq_len": orthros["train_config"]["seq_len"], "n_per_cell": n,
                  "chance": 1 / task["n_values"], "models": models, "accuracy": accuracy,
                  "needle_distance": [[needle_distance(L, d) for d in depths] for L in lens]},
         S, runs.values())


def conversion_runs(S, task, base, seed):
    """Table 2's rows: (a) converted, M more steps; (b) Base CPT, M more; (c) converted, no more."""
    n_steps = load_checkpoint(base.out_dir / "ckpt_last.pt")["step"]
    m_steps = max(1, int(n_steps * S["cont_frac"]))
    args = [*S[task].split(), "--init_from", str(base.out_dir / "ckpt_last.pt"),
            "--warmup_iters", str(max(1, m_steps // 10)), "--eval_interval", str(m_steps),
            "--curriculum", "", "--seed", str(seed)]  # continue on the full task
    rows = {"a_orthros_converted": ["--attn", "orthros", "--max_iters", str(m_steps)],
            "b_transformer_cpt": ["--attn", "transformer", "--max_iters", str(m_steps)],
            "c_orthros_untrained": ["--attn", "orthros", "--max_iters", "0"]}
    return n_steps, m_steps, {row: Run(S["out"] / f"conv-{task}-{row}-seed{seed}", [*args, *extra],
                                       exact_match=base.exact_match) for row, extra in rows.items()}


def step_conversion(S):
    """Table 2 from the lm Transformers (one a seed) and the recall one; M = N/4 more steps."""
    seeds = S["seeds"]
    ensure_prepared("stdlib")
    bases = {("lm", seed): run for (_, seed), run in lm_runs(S, seeds, ["transformer"]).items()}
    bases["recall", seeds[0]] = recall_runs(S, ["transformer"])["transformer"]
    launch(bases.values(), S)  # the lm and recall steps trained them, unless they have not run
    plans = {key: conversion_runs(S, key[0], base, key[1]) for key, base in bases.items()}
    all_runs = [run for _, _, runs in plans.values() for run in runs.values()]
    launch(all_runs, S)
    rows = {}
    for key, (_, _, runs) in plans.items():
        base_after = read_val_curve(bases[key].out_dir)[-1][1]
        rows[key] = {"base_transformer": {"val_loss_after": base_after}}
        for row, run in runs.items():
            curve = read_val_curve(run.out_dir)
            rows[key][row] = {"val_loss_before": curve[0][1], "val_loss_after": curve[-1][1],
                              **({"exact_match": read_json(run.out_dir / "exact_match.json")}
                                 if run.exact_match else {})}
    lm_rows = {row: {field: stats(rows["lm", s][row][field] for s in seeds) for field in fields}
               for row, fields in rows["lm", seeds[0]].items()}
    (n_lm, m_lm, _), (n_rec, m_rec, _) = plans["lm", seeds[0]], plans["recall", seeds[0]]
    lm_rows["base_transformer"]["steps"] = n_lm
    rows["recall", seeds[0]]["base_transformer"]["steps"] = n_rec
    after = {row: fields["val_loss_after"] for row, fields in lm_rows.items()}
    save("conversion", {"seeds": seeds, "lm": {"N": n_lm, "M": m_lm, "rows": lm_rows},
        "recall": {"N": n_rec, "M": m_rec, "seed": seeds[0], "rows": rows["recall", seeds[0]]},
        "comparisons": [compare(a, b, after[a], after[b], "lm val_loss_after")
                        for a, b in CONVERSION_COMPARISONS]}, S, all_runs)


def parse_sample_json(stdout):
    """`sample.py --json`'s measurements: the last line of its stdout."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ValueError("sample.py --json did not end its output with a JSON line; it printed: "
                         f"{lines[-1][:200] if lines else 'nothing'!r}") from None


def step_inference(S):
    """sample.py's time to first token and decode speed on the lm models (first seed)."""
    runs = lm_runs(S, S["seeds"][:1])
    launch(runs.values(), S)
    decoders = ["naive", "fast"] if pick_device() == "cuda" else ["naive"]
    files = sorted(Path(sys.prefix).rglob("*.py"))[:400]
    text = "".join(p.read_text(errors="replace") for p in files)
    keep = ("decoder", "prompt_tokens", "ttft_ms", "decode_tokens_per_s", "new_tokens", "batch")
    rows, cmds = [], []
    for T in S["prompt_lens"]:
        prompt = S["out"] / f"prompt-{T}.txt"
        atomic_write(prompt, lambda f: f.write(text[:T]), mode="w")  # byte tokenizer: ~T tokens
        for ((name, _), run), decoder in itertools.product(runs.items(), decoders):
            cmd = [sys.executable, "sample.py", "--ckpt", str(run.out_dir / "ckpt_last.pt"),
                   "--prompt_file", str(prompt), "--max_new_tokens", str(S["new_tokens"]),
                   "--temperature", "0", "--warmup", "--decoder", decoder, "--no_stop", "--json"]
            cmds.append(shlex.join(cmd))
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"failed ({done.returncode}): {cmds[-1]}\n{done.stderr[-3000:]}")
            r = parse_sample_json(done.stdout)
            rows.append({"model": name, **{k: r[k] for k in keep}})
            print(rows[-1], flush=True)
    save("inference", {"seed": S["seeds"][0], "sample_commands": cmds, "rows": rows}, S,
         runs.values())


# -- The gap: why Orthros trails the Transformer at nanoGPT's shakespeare_char ---------------

# Each group: (corpus, dropout, length in S["gap_iters"], models); a seed gives its runs the same
# initial weights, batches and evaluation batches. "char": data/shakespeare_char, 1.0M characters,
# seen 13 times in 800 steps of 64 x 256; "src": S["gap_src"], on the GPU 21M bytes of Python
# (torch's .py files: GAP_SRC_PREPARE), seen 0.6 times.
GAP_GROUPS = {
    "char-d0.2": ("char", "0.2", "long", ("transformer", "orthros")),  # the benchmark, shortened
    "char-d0": ("char", "0.0", "short", ("transformer", "orthros", "orthros_noso")),  # the paper's
    "src-d0": ("src", "0.0", "long", ("transformer", "orthros")),  # as the paper, no repeats
}
GAP_COMPARISONS = [("char-d0.2/orthros", "char-d0.2/transformer"),
                   ("char-d0/orthros", "char-d0/transformer"),
                   ("char-d0/orthros_noso", "char-d0/transformer"),
                   ("char-d0/orthros", "char-d0/orthros_noso"),
                   ("src-d0/orthros", "src-d0/transformer")]
GAP_SRC_PREPARE = ("python data/stdlib/prepare.py --max_files 990 --out_dir data/torchsrc "
                   "--src_dir $(python -c 'import torch; print(torch.__path__[0])')")


def gap_runs(S, seeds):
    data = {"char": "shakespeare_char", "src": S["gap_src"]}
    return {(f"{group}/{model}", seed): Run(S["out"] / f"gap-{group}-{model}-seed{seed}", (
        f"{S['gap']} --dataset {data[corpus]} --dropout {dropout} --max_iters "
        f"{S['gap_iters'][length]} {LM_MODELS[model]} --seed {seed}").split())
        for group, (corpus, dropout, length, models) in GAP_GROUPS.items()
        for model in models for seed in seeds}


def gap_summary(evals, max_iters):
    """A run's best val loss after step 0, the step and train loss there, and its curves."""
    best = min((r for step, r in evals.items() if step > 0), key=lambda r: r["val_loss"])
    return {"best_val": best["val_loss"], "best_step": best["step"],
            "train_at_best": best["train_loss"], "finished": max(evals) >= max_iters,
            "steps": list(evals), "train": [r["train_loss"] for r in evals.values()],
            "val": [r["val_loss"] for r in evals.values()]}


def gap_compare(evals, a, b, seeds):
    """a - b in best val loss seed by seed, over the steps both reached; their mean and std."""
    per_seed = {}
    for seed in seeds:
        ea, eb = evals.get((a, seed), {}), evals.get((b, seed), {})
        if common := sorted(set(ea) & set(eb) - {0}):
            best_a, best_b = (min(e[step]["val_loss"] for step in common) for e in (ea, eb))
            per_seed[seed] = {"up_to_step": common[-1], "a": best_a, "b": best_b,
                              "diff": best_a - best_b}
    diffs = [d["diff"] for d in per_seed.values()]
    return {"a": a, "b": b, "per_seed": per_seed, **(stats(diffs) if diffs else {})}


def step_gap(S):
    """GAP_GROUPS' runs, all at once; results/gap.json every 30 s and however it ends."""
    seeds = S["seeds"]
    for name in ("shakespeare_char", S["gap_src"]):
        if os.sep not in name:
            ensure_prepared(name)  # once, before the concurrent runs would each try
        elif not (Path(name) / "meta.json").exists():
            sys.exit(f"error: {name} is not prepared; make it with\n    {GAP_SRC_PREPARE}")
    runs, written = gap_runs(S, seeds), [0.0]

    def write(every=0.0):
        if time.time() - written[0] < every:
            return
        written[0] = time.time()
        evals = {key: read_evals(run.out_dir) for key, run in runs.items()
                 if (run.out_dir / "log.jsonl").exists()}
        evals = {key: e for key, e in evals.items() if len(e) > 1}  # evaluated after step 0
        summary = {f"{arm} seed{seed}": gap_summary(e, int(runs[arm, seed].given["max_iters"]))
                   for (arm, seed), e in evals.items()}
        best = {arm: [s["best_val"] for key, s in summary.items() if key.startswith(f"{arm} ")]
                for arm, _ in evals}
        save("gap", {"seeds": seeds, "groups": GAP_GROUPS,
                     "best_val_loss": {arm: stats(values) for arm, values in best.items()},
                     "comparisons": [gap_compare(evals, a, b, seeds) for a, b in GAP_COMPARISONS],
                     "runs": summary}, S, runs.values())
    # The costliest first (Orthros runs twice the tokens through its layers): with --parallel
    # below the run count, the cheap runs fill in at the end, not one long run alone.
    cost = lambda run: int(run.given["max_iters"]) * (2 if run.given["attn"] == "orthros" else 1)
    try:
        launch(sorted(runs.values(), key=cost, reverse=True), S, keep_going=True,
               tick=lambda: write(every=30.0))
    finally:
        write()


# -- Plots (matplotlib is not a dependency of the repository) ---------------------------------

def seeds_label(n):
    return f"{n} seed{'s' * (n > 1)}"


def plot_means(ax, labels, summaries, colors, floor):
    """Bars of the means with the stds; the y axis from floor x the least."""
    means = [s["mean"] for s in summaries]
    ax.bar(labels, means, yerr=[s["std"] or 0.0 for s in summaries], capsize=4, color=colors)
    ax.set_ylim(min(means) * floor, None)


def plot_lm(plt, lm):
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 2])
    for name, c in lm["curves"].items():
        steps, mean = c["steps"][1:], c["mean"][1:]  # step 0 squashes the plot
        std = [s or 0.0 for s in c["std"][1:]]
        line, = ax.plot(steps, mean, label=name)
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                        [m + s for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="val loss (nats per byte)", title="LM on the stdlib corpus, "
           f"mean ± std of {seeds_label(len(lm['seeds']))} ({lm['meta']['device']})")
    ax.legend(), ax.grid(alpha=0.3)
    final = lm["final_val_loss"]
    plot_means(bars, list(final), final.values(), [f"C{i}" for i in range(len(final))], 0.95)
    bars.set(ylabel="final val loss", title="final val loss (error bars: std over seeds)")
    bars.tick_params(axis="x", labelrotation=20)


def plot_accuracy(ax, name, accuracy, rotation=30):
    ax.plot(range(len(accuracy)), [a["accuracy"] for a in accuracy.values()], marker="o",
            label=name)
    ax.set_xticks(range(len(accuracy)), list(accuracy), rotation=rotation)


def plot_recall(plt, rec):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, acc in rec["accuracy"].items():
        plot_accuracy(ax, name, acc)
    ax.set(xlabel="distance from the query back to its key (tokens)", ylabel="exact match",
           ylim=(-0.02, 1.02), title=f"In-context recall by distance (window {rec['window']}, "
           f"{rec['meta']['device']})")
    ax.legend(), ax.grid(alpha=0.3)


def plot_niah(plt, grid):
    from matplotlib.patches import Rectangle
    lens, depths, models = grid["context_lens"], grid["depths"], grid["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.3 * len(models), 4.2), sharey=True,
                             squeeze=False)
    n_trained = sum(L <= grid["trained_context"] for L in lens)  # rows inside the trained length
    for ax, (name, info) in zip(axes[0], models.items()):
        im = ax.imshow(grid["accuracy"][name], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid["accuracy"][name]):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
                if info["reach"] is not None and grid["needle_distance"][i][j] > info["reach"]:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", lw=0,
                                           alpha=0.35))
        if 0 < n_trained < len(lens):
            ax.axhline(n_trained - 0.5, color="black", lw=2, ls="--")
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(lens)), lens)
        reach = "all tokens" if info["reach"] is None else \
            f"{info['n_layer']}x{info['window']} = {info['reach']} tokens"
        ax.set(xlabel="needle depth (0 = start of the context)",
               title=f"{name}\nwindow reach: {reach}")
    axes[0][0].set_ylabel("context length (tokens)")
    fig.colorbar(im, ax=axes[0].tolist(), label="exact match")
    fig.suptitle(f"Needle in a haystack: window {grid['window']}, {grid['n_per_cell']} needles per "
                 f"cell, trained on {grid['trained_context']}-token contexts (dashed line)\n"
                 "hatched: the needle lies beyond the window reach n_layer x window; chance "
                 f"{grid['chance']:.2f}", y=1.08)


def plot_conversion(plt, conv):
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), width_ratios=[3, 1.3, 3])
    labels = ["base\n(N steps)", "(c) converted,\nuntrained", "(a) converted\n+M steps",
              "(b) base CPT\n+M steps"]
    after = [conv["lm"]["rows"][name]["val_loss_after"] for name in CONVERSION_ROWS]
    plot_means(axes[0], labels, after, ["gray", "tab:olive", "tab:green", "tab:blue"], 0.97)
    axes[0].set(ylabel="val loss", title=f"LM (N={conv['lm']['N']}, M={conv['lm']['M']}; "
                f"mean ± std of {seeds_label(len(conv['seeds']))})")
    axes[0].tick_params(axis="x", labelsize=8)
    # Each seed's (a) and (b) share a base and the evaluation batches: their difference is paired.
    paired = conv["comparisons"][0]["per_seed_diffs"]  # (a) - (b): CONVERSION_COMPARISONS[0]
    axes[1].scatter([0] * len(paired), paired, color="tab:green", zorder=3)
    axes[1].axhline(0, color="black", lw=1)
    axes[1].set(xticks=[], xlim=(-1, 1), ylabel="val loss difference",
                title="(a) - (b), per seed\n(< 0: conversion wins)")
    for name, label in zip(CONVERSION_ROWS[1:], labels[1:]):
        accuracy = conv["recall"]["rows"][name]["exact_match"]
        plot_accuracy(axes[2], label.replace("\n", " "), accuracy)
    axes[2].set(ylabel="exact match", ylim=(min(0.8, axes[2].get_ylim()[0]), 1.01),
                title=f"recall (N={conv['recall']['N']}, M={conv['recall']['M']})")
    axes[2].legend(fontsize=7)


def plot_inference(plt, inf):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    models = list(dict.fromkeys(r["model"] for r in inf["rows"]))
    decoders = list(dict.fromkeys(r["decoder"] for r in inf["rows"]))
    width = 0.8 / len(decoders)
    for k, decoder in enumerate(decoders):
        by_model = {r["model"]: r for r in inf["rows"] if r["decoder"] == decoder}
        x = [i + (k - (len(decoders) - 1) / 2) * width for i in range(len(models))]
        axes[0].bar(x, [by_model[m]["ttft_ms"] for m in models], width, label=decoder)
        axes[1].bar(x, [by_model[m]["decode_tokens_per_s"] or 0 for m in models], width,
                    label=decoder)
    row = inf["rows"][0]
    axes[0].set(ylabel="ms", title=f"time to first token ({row['prompt_tokens']}-token prompt)")
    axes[1].set(ylabel="tokens/s", title=f"decode (batch {row['batch']})")
    for ax in axes:
        ax.set_xticks(range(len(models)), models, rotation=20)
        ax.legend(title="decoder", fontsize=7)


def plot_gap(plt, gap):
    fig, axes = plt.subplots(1, len(gap["groups"]), figsize=(5 * len(gap["groups"]), 3.8),
                             squeeze=False)
    for ax, group in zip(axes[0], gap["groups"]):
        for i, model in enumerate(gap["groups"][group][3]):
            runs = [r for name, r in gap["runs"].items() if name.startswith(f"{group}/{model} ")]
            n = min((len(r["steps"]) for r in runs), default=0)  # the steps every seed reached
            for key, style in (("val", "-"), ("train", "--")) if n > 1 else ():
                mean = [statistics.fmean(r[key][j] for r in runs) for j in range(1, n)]
                ax.plot(runs[0]["steps"][1:n], mean, style, color=f"C{i}", marker=".",
                        label=f"{model} {key} ({seeds_label(len(runs))})")
        ax.set(xlabel="step", ylabel="loss (nats per character or byte)", title=group)
        ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.suptitle("Orthros and the Transformer by regime, mean over seeds "
                 f"({gap['meta']['device']})")


PLOTS = {"lm": (plot_lm, "lm_val_loss"), "recall": (plot_recall, "recall_by_distance"),
         "niah": (plot_niah, "niah"), "conversion": (plot_conversion, "conversion"),
         "inference": (plot_inference, "inference"), "gap": (plot_gap, "gap")}


def step_plots(S):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["figure.constrained_layout.use"] = True  # room for every label, title, colorbar
    suffix = "" if S["name"] == "gpu" else f"_{S['name']}"
    for name, (plot, png) in PLOTS.items():
        if (path := RESULTS / f"{name}{suffix}.json").exists():
            plot(plt, read_json(path))
            plt.savefig(RESULTS / f"{png}{suffix}.png", dpi=120, bbox_inches="tight")
            plt.close("all")
            print(f"wrote {RESULTS / f'{png}{suffix}.png'}")


STEPS = {"lm": step_lm, "recall": step_recall, "niah": step_niah, "conversion": step_conversion,
         "inference": step_inference, "gap": step_gap, "plots": step_plots}


def main(argv=None):
    t_start = time.time()
    os.chdir(REPO)  # the commands it runs (train.py, sample.py), results/ and out/ are the repo's
    parser = ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="+", choices=[*STEPS, "all"])
    parser.add_argument("--scale", default="gpu", choices=list(SCALES))
    parser.add_argument("--seeds", type=int, default=1, help="seeds for lm and conversion: 1337...")
    parser.add_argument("--parallel", type=int, default=0, help="trainings at once (default 0: "
                        "all of a step's on a GPU, one by one otherwise)")
    parser.add_argument("--time_limit", type=float, default=None, metavar="SECONDS", help="stop "
                        "the trainings (they save checkpoints) after this long; rerun to continue")
    parser.add_argument("--results", default="results", metavar="DIR",
                        help="where the JSON files go (default: results)")
    args = parser.parse_args(argv)
    global RESULTS
    RESULTS = Path(args.results)
    if args.seeds < 1 or args.parallel < 0:
        parser.error("--seeds must be >= 1 and --parallel >= 0")
    S = {"name": args.scale, **SCALES[args.scale], "out": Path("out") / f"exp-{args.scale}",
         "seeds": [FIRST_SEED + i for i in range(args.seeds)],
         "parallel": args.parallel or (0 if pick_device() == "cuda" else 1),
         "deadline": None if args.time_limit is None else t_start + args.time_limit}
    for name in (list(STEPS) if "all" in args.steps else args.steps):
        t0 = time.time()
        STEPS[name](S)
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
