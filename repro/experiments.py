"""
Reproduce the paper's claims at classroom scale, with our own train.py and sample.py.

    python repro/experiments.py lm --seeds 3     # LM quality: transformer, swa, orthros, orthros w/o SO (Table 1, Fig. 2)
    python repro/experiments.py recall           # recall by distance (Table 3)
    python repro/experiments.py niah             # needle-in-a-haystack grids of the three recall models (Figure 3)
    python repro/experiments.py conversion --seeds 3   # transformer -> orthros vs. continued transformer (Table 2)
    python repro/experiments.py inference        # time to first token and decode speed of the LM models (Table 4)
    python repro/experiments.py gap --seeds 3    # why Orthros trails at shakespeare_char
    python repro/experiments.py plots            # PNGs from the JSONs (needs matplotlib)
    python repro/experiments.py recall niah --scale cpu   # the recall_tiny version (window 32), CPU minutes
    python repro/experiments.py all --scale tiny --seeds 2   # every step, tiny: a smoke test

Each step runs the same commands a user would (python train.py ..., python sample.py ...),
--parallel of them at once (default: all at once on a GPU, where they share it; one by one on
CPU), reads what they wrote, and saves results/<step>.json with the commands, the device, torch
version, date and git commit. The runs go to out/exp-<scale>/<step>-<model>-seed<seed>/.

Seeds: --seeds N runs the lm and conversion models with seeds 1337, 1338, ..., 1336 + N (1337
is train.py's default) and reports the mean and the sample standard deviation over seeds;
recall, niah and inference use the first seed's models only.

Steps build on each other (conversion starts from the lm transformers, niah evaluates the recall
models, inference times the lm models); a step trains what it needs if it is missing. Re-running
a command continues where it stopped: finished runs are skipped, runs with a checkpoint short of
their last step are resumed (--init_from resume), runs that died before their first checkpoint
are restarted. --time_limit S stops the trainings after S seconds (they save their checkpoints on
SIGTERM) so that a command ends cleanly inside a time limit; SIGTERM to this script does the same.
"""

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python repro/experiments.py): import from the repository root
from data.prepare_utils import atomic_write, ensure_prepared, load_meta
from checkpoint import load_checkpoint, model_from_checkpoint, pick_device, run_meta
from data.recall.prepare import make_example
from data.sft import encode_example, exact_match
from data.tokenizer import get_tokenizer

RESULTS = Path("results")
FIRST_SEED = 1337  # train.py's default seed
LM_MODELS = {"transformer": ["--attn", "transformer"], "swa": ["--attn", "swa"],
             "orthros": ["--attn", "orthros"], "orthros_noso": ["--attn", "orthros", "--scale_offset", "false"]}
LM_COMPARISONS = [("orthros", "transformer"), ("orthros", "swa"), ("orthros", "orthros_noso")]
RECALL_MODELS = ("orthros", "transformer", "swa")
CONVERSION_COMPARISONS = [("a_orthros_converted", "b_transformer_cpt"), ("a_orthros_converted", "c_orthros_untrained"),
                          ("c_orthros_untrained", "base_transformer")]
NIAH_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# The gap step's models at CPU scale: a smoke test of its wiring, seconds a run.
GAP_TINY = dict(gap="--config shakespeare_char --n_layer 1 --n_head 2 --n_embd 32 --window 16 "
                    "--seq_len 32 --batch_size 4 --eval_interval 4 --eval_iters 2 "
                    "--warmup_iters 2".split(),
                gap_src="stdlib", gap_iters={"long": 8, "short": 4})
# How long each run is: "gpu" is sized for minutes on one H200, "tiny" for a CPU smoke test.
SCALES = {
    "gpu": dict(lm=["--config", "small", "--max_iters", "1500"], recall=["--config", "recall"], recall_data="recall",
                gap="--config shakespeare_char --eval_interval 100 --eval_iters 10".split(),
                gap_src="data/torchsrc", gap_iters={"long": 800, "short": 600},
                cont_frac=0.25, niah_lens=[256, 512, 1024, 2048, 4096, 8192], niah_n=100,
                prompt_lens=[32768], new_tokens=128),
    # CPU scale, for the recall and NIAH results when no GPU time is left: recall_tiny (window 32)
    "cpu": dict(lm=["--config", "tiny"], recall=["--config", "recall_tiny"], recall_data="recall_tiny",
                **GAP_TINY, cont_frac=0.25, niah_lens=[64, 128, 256, 300, 512, 1024], niah_n=40,
                prompt_lens=[4096], new_tokens=64),
    "tiny": dict(lm=["--config", "tiny", "--max_iters", "30", "--eval_interval", "15", "--eval_iters", "2"],
                 recall=["--config", "recall_tiny", "--max_iters", "30", "--eval_interval", "15", "--eval_iters", "2",
                         "--eval_exact_match", "20"], recall_data="recall_tiny", **GAP_TINY,
                 cont_frac=0.5, niah_lens=[64, 128], niah_n=4, prompt_lens=[512], new_tokens=8),
}


# -----------------------------------------------------------------------------
# Training runs: what each one is, whether it has finished, and running them

@dataclass
class Run:
    """One train.py run: its arguments (pairs "--key", "value"), the folder it writes, and whether
    it ends by writing exact_match.json (SFT on a task with a test split)."""
    out_dir: Path
    args: list
    exact_match: bool = False

    @property
    def cmd(self):
        return [sys.executable, "train.py", *self.args, "--out_dir", str(self.out_dir)]

    @property
    def given(self):
        """{key: value} of the arguments; a key given twice keeps its last value, as in train.py."""
        return {k.removeprefix("--"): v for k, v in zip(self.args[::2], self.args[1::2])}

    @property
    def log(self):
        return self.out_dir.with_name(self.out_dir.name + ".log")  # beside the run's folder, not in it


def run_state(run):
    """'done', 'resume' (a checkpoint short of the last step, or the final exact match missing),
    'overwrite' (files but no checkpoint: it died before its first save) or 'fresh'. A folder
    whose checkpoint comes from other arguments is an error: nothing overwrites another run."""
    last = run.out_dir / "ckpt_last.pt"
    results_written = not run.exact_match or (run.out_dir / "exact_match.json").exists()
    if last.exists():
        ckpt = load_checkpoint(last)
        config = {**ckpt["train_config"], "config": ckpt.get("config_name")}
        differ = [f"--{k} {config[k]!r} there, {v!r} here" for k, v in run.given.items()
                  if k in config and k != "init_from" and str(config[k]).lower() != v.lower()]
        if differ:
            sys.exit(f"error: {run.out_dir} holds another run ({'; '.join(differ)}); "
                     "move it away, or delete it to train this one")
        return "done" if ckpt["step"] >= ckpt["train_config"]["max_iters"] and results_written else "resume"
    if run.given.get("max_iters") == "0":  # an evaluation only: train.py saves no checkpoint
        if (run.out_dir / "log.jsonl").exists() and read_val_curve(run.out_dir) and results_written:
            return "done"
    return "overwrite" if run.out_dir.is_dir() and any(run.out_dir.iterdir()) else "fresh"


class Stop(Exception):
    """A failed run, SIGTERM, or past --time_limit: the trainings are stopped and the command ends
    with this exit status."""
    def __init__(self, why, status=3):
        super().__init__(why)
        self.status = status


def run_all(jobs, parallel, deadline, keep_going=False, tick=None):
    """Run the (command, log path) jobs, `parallel` at a time. On a failure (unless keep_going: then
    the others go on), on SIGTERM or past the deadline, the running trainings get SIGTERM (train.py
    then saves ckpt_last.pt) and this process exits: running the same command again continues them.
    tick(), if given, is called twice a second while they run."""
    pending, running = list(jobs), []
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, min(parallel, len(jobs))))))

    def on_sigterm(signum, frame):
        raise Stop("SIGTERM")
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while pending or running:
            if deadline is not None and time.time() > deadline:
                raise Stop("--time_limit reached")
            while pending and len(running) < parallel:
                cmd, log = pending.pop(0)
                print("$", shlex.join(cmd), flush=True)
                with open(log, "a") as f:  # appended: a resumed run keeps the earlier attempts' output
                    running.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), cmd, log))
            for job in [j for j in running if j[0].poll() is not None]:
                running.remove(job)
                if job[0].returncode != 0:
                    tail = "".join(open(job[2], errors="replace").readlines()[-15:])
                    why = f"failed ({job[0].returncode}): {shlex.join(job[1])}\n{tail}see {job[2]}"
                    if not keep_going:
                        raise Stop(why, status=1)
                    print(why, file=sys.stderr, flush=True)
            if tick is not None:
                tick()
            time.sleep(0.5)
    except Stop as why:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        print(f"stopped: {why}", file=sys.stderr)
        running = [p for p, _, _ in running if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        for p in running:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        print(f"{len(running)} trainings still running got SIGTERM (train.py saves ckpt_last.pt then); "
              "the same command continues every unfinished run.", file=sys.stderr)
        sys.exit(why.status)
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(runs, S, **run_all_options):
    """Bring every run to its end: finished runs are skipped, the others started, resumed or restarted."""
    runs, jobs = list(runs), []
    for run in runs:
        state = run_state(run)
        if state != "done":
            run.out_dir.parent.mkdir(parents=True, exist_ok=True)
            extra = {"resume": ["--init_from", "resume"], "overwrite": ["--overwrite", "true"], "fresh": []}[state]
            jobs.append(([*run.cmd, *extra], run.log))
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
    """{step: evaluation record} from a run's log.jsonl, by step. A resumed run may log a step
    twice: the later record wins. A line cut short by a kill is skipped."""
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
    """[(step, val_loss)] from a run's log.jsonl (read_evals)."""
    return [(step, record["val_loss"]) for step, record in read_evals(out_dir).items()]


def read_json(path):
    return json.loads(Path(path).read_text())


# -----------------------------------------------------------------------------
# Seeds: the spread, and which differences are larger than it

def stats(values):
    """Per-seed values -> {"values", "mean", "std"}: std is the sample standard deviation
    (ddof=1), None for a single seed."""
    values = list(values)
    return {"values": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None}


def compare(a, b, a_stats, b_stats, metric):
    """Is a - b larger than the seeds' spread? Two readings: the difference of the means against
    std_a + std_b, and the per-seed differences (seed i of a against seed i of b: the same
    training batches and evaluation batches, and in conversion the same base model)."""
    diff = a_stats["mean"] - b_stats["mean"]
    per_seed = [x - y for x, y in zip(a_stats["values"], b_stats["values"])]
    spread = a_stats["std"] + b_stats["std"] if a_stats["std"] is not None and b_stats["std"] is not None else None
    same_sign = (all(d > 0 for d in per_seed) or all(d < 0 for d in per_seed)) if len(per_seed) > 1 else None
    return {"a": a, "b": b, "metric": metric, "diff_mean": diff, "rel_diff": diff / b_stats["mean"],
            "spread": spread, "larger_than_spread": abs(diff) > spread if spread is not None else None,
            "per_seed_diffs": per_seed, "same_sign_every_seed": same_sign}


def seed_list(S):
    return [FIRST_SEED + i for i in range(S["seeds"])]


# -----------------------------------------------------------------------------
# The steps

def lm_runs(S, seeds, names=tuple(LM_MODELS)):
    return {(name, seed): Run(S["out"] / f"lm-{name}-seed{seed}", [*S["lm"], *LM_MODELS[name], "--seed", str(seed)])
            for name in names for seed in seeds}


def recall_runs(S, names=RECALL_MODELS):
    """The recall models, first seed only (the recall and niah steps, the recall conversion)."""
    seed = seed_list(S)[0]
    ensure_prepared(S["recall_data"])  # once, before the concurrent runs would each try
    return {attn: Run(S["out"] / f"recall-{attn}-seed{seed}", [*S["recall"], "--attn", attn, "--seed", str(seed)],
                      exact_match=True) for attn in names}


def save(name, obj, S, runs=()):
    """results/<name>.json at GPU scale, results/<name>_<scale>.json otherwise, atomically."""
    path = RESULTS / (f"{name}.json" if S["name"] == "gpu" else f"{name}_{S['name']}.json")
    obj = {"meta": {**run_meta(pick_device()), "commands": [shlex.join(run.cmd) for run in runs]}, **obj}
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1) + "\n"), mode="w")
    print(f"wrote {path}", flush=True)


def step_lm(S):
    """Equal tokens for the four models on the default corpus, each seed: val-loss curves and
    final losses, mean and std over seeds."""
    seeds = seed_list(S)
    ensure_prepared("stdlib")  # once, before the concurrent runs would each try
    runs = lm_runs(S, seeds)
    launch(runs.values(), S)
    curves = {key: read_val_curve(run.out_dir) for key, run in runs.items()}
    out = {"seeds": seeds, "final_val_loss": {}, "best_val_loss": {}, "curves": {}}
    for name in LM_MODELS:
        per_seed = [curves[name, s] for s in seeds]
        steps = [step for step, _ in per_seed[0]]
        if any([step for step, _ in c] != steps for c in per_seed):
            sys.exit(f"error: the {name} runs evaluated at different steps; were they trained with other arguments?")
        out["final_val_loss"][name] = stats(c[-1][1] for c in per_seed)
        out["best_val_loss"][name] = stats(min(v for _, v in c) for c in per_seed)
        by_step = [stats(c[i][1] for c in per_seed) for i in range(len(steps))]
        out["curves"][name] = {"steps": steps, "per_seed": [[v for _, v in c] for c in per_seed],
                               "mean": [s["mean"] for s in by_step], "std": [s["std"] for s in by_step]}
    final = out["final_val_loss"]
    out["comparisons"] = [compare(a, b, final[a], final[b], "final_val_loss") for a, b in LM_COMPARISONS]
    save("lm", out, S, runs.values())


def step_recall(S):
    """Recall by distance for the three models (window 128 at GPU scale)."""
    runs = recall_runs(S)
    launch(runs.values(), S)
    accuracy = {attn: read_json(run.out_dir / "exact_match.json") for attn, run in runs.items()}
    window = load_checkpoint(runs["orthros"].out_dir / "ckpt_last.pt")["model_config"]["window"]
    save("recall", {"seed": seed_list(S)[0], "window": window, "accuracy": accuracy}, S, runs.values())


def needle_distance(context_len, depth):
    """Tokens from the query back to the needle's key, for a needle at depth (0 = the start of
    the context, 1 = just before the query): the key sits at round(depth * (context_len - 2))
    and the query's key at context_len + 1 (make_example's layout)."""
    return context_len + 1 - round(depth * (context_len - 2))


def niah_examples(context_lens, depths, n_per_cell, task_params, tokenizer):
    """n_per_cell needles per (context length, depth): recall examples with one query, the other
    pairs of the task scattered around the needle. Bucket "L:depth"."""
    rng, examples = random.Random(0), []
    shape = {k: task_params[k] for k in ("n_pairs", "n_keys", "n_values")}
    for L in context_lens:
        for depth in depths:
            for _ in range(n_per_cell):
                ex = make_example(rng, L, n_queries=1, first_distance=needle_distance(L, depth), **shape)
                tokens, mask = encode_example(ex["turns"], tokenizer)
                examples.append({"tokens": tokens, "mask": mask, "bucket": f"{L}:{depth}"})
    return examples


def niah_accuracy(ckpt, examples, max_len, device):
    """Exact match per bucket of greedy generation through the KV cache (bf16 autocast on CUDA,
    as in train.py's own exact-match evaluation). The needles of one context length share a
    prompt length, so they go through generate() in batches."""
    # The blocked sliding window is exact and needs no compilation for each new length (flex does).
    model = model_from_checkpoint(ckpt, max_seq_len=max_len, swa_impl="blocked").to(device).eval()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()

    @torch.no_grad()
    def generate(prompts, n):
        idx = torch.tensor(prompts, device=device)
        with amp:
            return model.generate(idx, n, temperature=0)[:, idx.size(1):].tolist()
    return exact_match(examples, generate)


def step_niah(S, depths=NIAH_DEPTHS):
    """Needle in a haystack for the three recall models: exact match of one queried pair at each
    context length and depth, inside the trained length and beyond it."""
    runs = recall_runs(S)
    launch(runs.values(), S)  # trains the recall models if the recall step has not
    context_lens, n = S["niah_lens"], S["niah_n"]
    device = pick_device()
    ckpts = {attn: load_checkpoint(run.out_dir / "ckpt_last.pt") for attn, run in runs.items()}
    task = load_meta(ensure_prepared(ckpts["orthros"]["dataset"]))["params"]
    examples = niah_examples(context_lens, depths, n, task, get_tokenizer(ckpts["orthros"]["tokenizer"]))
    accuracy, models = {}, {}
    for attn, ckpt in ckpts.items():
        t0 = time.time()
        scores = niah_accuracy(ckpt, examples, max(context_lens) + 8, device)
        accuracy[attn] = [[scores[f"{L}:{d}"]["accuracy"] for d in depths] for L in context_lens]
        mc = ckpt["model_config"]
        models[attn] = {"ckpt": str(runs[attn].out_dir / "ckpt_last.pt"), "step": ckpt["step"],
                        "n_layer": mc["n_layer"], "window": mc["window"],
                        "reach": None if attn == "transformer" else mc["n_layer"] * mc["window"]}
        print(f"niah {attn}: {len(examples)} needles in {time.time() - t0:.0f} s", flush=True)
    save("niah", {"window": ckpts["orthros"]["model_config"]["window"],
                  "trained_context": task["context_len"], "trained_seq_len": ckpts["orthros"]["train_config"]["seq_len"],
                  "n_per_cell": n, "chance": 1 / task["n_values"], "context_lens": list(context_lens),
                  "depths": list(depths), "needle_distance": [[needle_distance(L, d) for d in depths] for L in context_lens],
                  "reach_note": "reach = n_layer * window, the farthest a stack of sliding windows sees; it bounds "
                                "SWA, not Orthros (whose output stream attends to every position) nor the Transformer",
                  "models": models, "accuracy": accuracy}, S, runs.values())


def conversion_runs(S, task, base, seed):
    """Table 2's rows from one base transformer: (a) converted to orthros, M more steps; (b) the
    transformer, M more steps (Base CPT); (c) converted, no training."""
    n_steps = load_checkpoint(base.out_dir / "ckpt_last.pt")["step"]
    m_steps = max(1, int(n_steps * S["cont_frac"]))
    args = [*S[task], "--init_from", str(base.out_dir / "ckpt_last.pt"), "--warmup_iters", str(max(1, m_steps // 10)),
            "--eval_interval", str(m_steps), "--curriculum", "", "--seed", str(seed)]  # continue on the full task
    rows = {"a_orthros_converted": ["--attn", "orthros", "--max_iters", str(m_steps)],
            "b_transformer_cpt": ["--attn", "transformer", "--max_iters", str(m_steps)],
            "c_orthros_untrained": ["--attn", "orthros", "--max_iters", "0"]}
    runs = {row: Run(S["out"] / f"conv-{task}-{row}-seed{seed}", [*args, *extra], exact_match=base.exact_match)
            for row, extra in rows.items()}
    return n_steps, m_steps, runs


def conversion_row(run):
    curve = read_val_curve(run.out_dir)
    row = {"val_loss_before": curve[0][1], "val_loss_after": curve[-1][1]}
    if run.exact_match:
        row["exact_match"] = read_json(run.out_dir / "exact_match.json")
    return row


def step_conversion(S):
    """Table 2 at toy scale. The bases are the lm transformers after N steps (one per seed) and the
    recall transformer (first seed); from each, rows (a), (b), (c) with M = N/4 more steps."""
    seeds = seed_list(S)
    ensure_prepared("stdlib")
    bases = {("lm", seed): run for (_, seed), run in lm_runs(S, seeds, ["transformer"]).items()}
    bases["recall", seeds[0]] = recall_runs(S, ["transformer"])["transformer"]
    launch(bases.values(), S)  # the lm and recall steps trained them, unless they have not run
    plans = {key: conversion_runs(S, key[0], base, key[1]) for key, base in bases.items()}
    all_runs = [run for _, _, runs in plans.values() for run in runs.values()]
    launch(all_runs, S)

    rows = {key: {row: conversion_row(run) for row, run in runs.items()} for key, (_, _, runs) in plans.items()}
    for key, base in bases.items():
        rows[key]["base_transformer"] = {"val_loss_after": read_val_curve(base.out_dir)[-1][1]}
    lm_rows = {row: {field: stats(rows["lm", s][row][field] for s in seeds) for field in rows["lm", seeds[0]][row]}
               for row in rows["lm", seeds[0]]}
    n_lm, m_lm, _ = plans["lm", seeds[0]]
    n_rec, m_rec, _ = plans["recall", seeds[0]]
    lm_rows["base_transformer"]["steps"] = n_lm
    rows["recall", seeds[0]]["base_transformer"]["steps"] = n_rec
    after = {row: fields["val_loss_after"] for row, fields in lm_rows.items()}
    save("conversion", {
        "seeds": seeds,
        "lm": {"N": n_lm, "M": m_lm, "rows": lm_rows},
        "recall": {"N": n_rec, "M": m_rec, "seed": seeds[0], "rows": rows["recall", seeds[0]]},
        "comparisons": [compare(a, b, after[a], after[b], "lm val_loss_after") for a, b in CONVERSION_COMPARISONS],
    }, S, all_runs)


def parse_sample_json(stdout):
    """The measurements of `sample.py --json`: one JSON object, the last line of its stdout."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ValueError("sample.py --json did not end its output with a JSON line; it printed: "
                         f"{lines[-1][:200] if lines else 'nothing'!r}") from None


def step_inference(S):
    """sample.py on each LM model (first seed) at long prompts: time to first token and decode
    tokens/s, with the naive KV cache decoder and, on CUDA, the fast one (static cache, CUDA graph)."""
    runs = lm_runs(S, seed_list(S)[:1])
    launch(runs.values(), S)
    decoders = ["naive", "fast"] if pick_device() == "cuda" else ["naive"]
    text = "".join(p.read_text(errors="replace") for p in sorted(Path(sys.prefix).rglob("*.py"))[:400])
    rows, cmds = [], []
    for T in S["prompt_lens"]:
        prompt = S["out"] / f"prompt-{T}.txt"
        atomic_write(prompt, lambda f: f.write(text[:T]), mode="w")  # byte tokenizer: ~T tokens
        for (name, _), run in runs.items():
            for decoder in decoders:
                cmd = [sys.executable, "sample.py", "--ckpt", str(run.out_dir / "ckpt_last.pt"), "--prompt_file",
                       str(prompt), "--max_new_tokens", str(S["new_tokens"]), "--temperature", "0", "--warmup",
                       "--decoder", decoder, "--no_stop", "--json"]
                cmds.append(shlex.join(cmd))
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"failed ({done.returncode}): {cmds[-1]}\n{done.stderr[-3000:]}")
                r = parse_sample_json(done.stdout)
                rows.append({"model": name, **{k: r[k] for k in ("decoder", "prompt_tokens", "ttft_ms",
                                                                 "decode_tokens_per_s", "new_tokens", "batch")}})
                print(rows[-1], flush=True)
    save("inference", {"seed": seed_list(S)[0], "sample_commands": cmds, "rows": rows}, S, runs.values())


# -----------------------------------------------------------------------------
# The gap: why Orthros trails the Transformer at nanoGPT's shakespeare_char

# Each group: (corpus, dropout, length in S["gap_iters"], models). One seed gives its runs the same
# initial weights, batches and evaluation batches. "char": data/shakespeare_char, 1.0M characters,
# seen 13 times in 800 steps of 64 x 256; "src": S["gap_src"], on the GPU 21M bytes of Python
# (torch's .py files: GAP_SRC_PREPARE), seen 0.6 times.
GAP_GROUPS = {
    "char-d0.2": ("char", "0.2", "long", ("transformer", "orthros")),  # the benchmark, shortened
    "char-d0": ("char", "0.0", "short", ("transformer", "orthros", "orthros_noso")),  # as the paper
    "src-d0": ("src", "0.0", "long", ("transformer", "orthros")),  # as the paper, nothing repeats
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
    return {(f"{group}/{model}", seed): Run(S["out"] / f"gap-{group}-{model}-seed{seed}", [
        *S["gap"], "--dataset", data[corpus], "--dropout", dropout,
        "--max_iters", str(S["gap_iters"][length]), *LM_MODELS[model], "--seed", str(seed)])
        for group, (corpus, dropout, length, models) in GAP_GROUPS.items()
        for model in models for seed in seeds}


def gap_summary(evals, max_iters):
    """One run's evaluations -> its best val loss (after step 0), the step and train loss there, and
    its curves."""
    best = min((r for step, r in evals.items() if step > 0), key=lambda r: r["val_loss"])
    return {"best_val": best["val_loss"], "best_step": best["step"],
            "train_at_best": best["train_loss"],
            "finished": max(evals) >= max_iters, "steps": list(evals),
            "train": [r["train_loss"] for r in evals.values()],
            "val": [r["val_loss"] for r in evals.values()]}


def gap_compare(evals, a, b, seeds):
    """a - b in best val loss, seed by seed, each over the steps that both runs reached (so a run
    cut short by the time limit still pairs with its twin); mean and std of the differences."""
    per_seed = {}
    for seed in seeds:
        ea, eb = evals.get((a, seed), {}), evals.get((b, seed), {})
        common = sorted(set(ea) & set(eb) - {0})
        if common:
            best_a, best_b = (min(e[step]["val_loss"] for step in common) for e in (ea, eb))
            per_seed[seed] = {"up_to_step": common[-1], "a": best_a, "b": best_b,
                              "diff": best_a - best_b}
    diffs = [d["diff"] for d in per_seed.values()]
    return {"a": a, "b": b, "per_seed": per_seed, **(stats(diffs) if diffs else {})}


def step_gap(S):
    """The Transformer and Orthros in the regimes of GAP_GROUPS, all at once, --seeds seeds. Writes
    results/gap.json every 30 s while they train and once more at the end, also when --time_limit or
    a failed run stops them early: what the runs have logged so far is never lost."""
    seeds = seed_list(S)
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
        logged = {key: run for key, run in runs.items() if (run.out_dir / "log.jsonl").exists()}
        evals = {key: read_evals(run.out_dir) for key, run in logged.items()}
        evals = {key: e for key, e in evals.items() if len(e) > 1}  # evaluated after step 0
        summary = {f"{arm} seed{seed}": gap_summary(e, int(runs[arm, seed].given["max_iters"]))
                   for (arm, seed), e in evals.items()}
        arms = {}
        for arm, seed in evals:
            arms.setdefault(arm, []).append(summary[f"{arm} seed{seed}"]["best_val"])
        save("gap", {"seeds": seeds, "groups": GAP_GROUPS,
                     "best_val_loss": {arm: stats(values) for arm, values in arms.items()},
                     "comparisons": [gap_compare(evals, a, b, seeds) for a, b in GAP_COMPARISONS],
                     "runs": summary}, S, runs.values())
    # The costliest first (Orthros runs twice the tokens through its layers): with --parallel below the
    # run count, the cheap runs fill in at the end instead of one long run trailing alone.
    cost = lambda run: int(run.given["max_iters"]) * (2 if run.given["attn"] == "orthros" else 1)
    try:
        launch(sorted(runs.values(), key=cost, reverse=True), S, keep_going=True,
               tick=lambda: write(every=30.0))
    finally:
        write()


# -----------------------------------------------------------------------------
# Plots (optional: matplotlib is not a dependency of the repo)

def errors(summaries):
    """Error-bar lengths: the std, 0 for a single seed."""
    return [s["std"] or 0.0 for s in summaries]


def plot_lm(plt, lm, path):
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name, c in lm["curves"].items():
        steps, mean, std = c["steps"][1:], c["mean"][1:], [s or 0.0 for s in c["std"][1:]]  # step 0 squashes the plot
        line, = ax.plot(steps, mean, label=name)
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2)
    n = len(lm["seeds"])
    ax.set(xlabel="step", ylabel="val loss (nats per byte)",
           title=f"LM on the stdlib corpus, mean ± std of {n} seed{'s' * (n > 1)} ({lm['meta']['device']})")
    ax.legend(), ax.grid(alpha=0.3)
    final = lm["final_val_loss"]
    bars.bar(list(final), [s["mean"] for s in final.values()], yerr=errors(final.values()), capsize=4,
             color=[f"C{i}" for i in range(len(final))])
    lo = min(s["mean"] for s in final.values())
    bars.set(ylabel="final val loss", ylim=(lo * 0.95, None), title="final val loss (error bars: std over seeds)")
    bars.tick_params(axis="x", labelrotation=20)
    fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_recall(plt, rec, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, acc in rec["accuracy"].items():
        ax.plot(range(len(acc)), [a["accuracy"] for a in acc.values()], marker="o", label=name)
    buckets = list(next(iter(rec["accuracy"].values())))
    ax.set_xticks(range(len(buckets)), buckets, rotation=30)
    ax.set(xlabel="distance from the query back to its key (tokens)", ylabel="exact match", ylim=(-0.02, 1.02),
           title=f"In-context recall by distance (window {rec['window']}, {rec['meta']['device']})")
    ax.legend(), ax.grid(alpha=0.3), fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_niah(plt, grid, path):
    from matplotlib.patches import Rectangle
    lens, depths, models = grid["context_lens"], grid["depths"], grid["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.3 * len(models), 4.2), sharey=True, squeeze=False)
    n_trained = sum(L <= grid["trained_context"] for L in lens)  # rows inside the trained length
    for ax, (name, info) in zip(axes[0], models.items()):
        im = ax.imshow(grid["accuracy"][name], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid["accuracy"][name]):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
                if info["reach"] is not None and grid["needle_distance"][i][j] > info["reach"]:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", lw=0, alpha=0.35))
        if 0 < n_trained < len(lens):
            ax.axhline(n_trained - 0.5, color="black", lw=2, ls="--")
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(lens)), lens)
        reach = "all tokens" if info["reach"] is None else f"{info['n_layer']}x{info['window']} = {info['reach']} tokens"
        ax.set(xlabel="needle depth (0 = start of the context)", title=f"{name}\nwindow reach: {reach}")
    axes[0][0].set_ylabel("context length (tokens)")
    fig.colorbar(im, ax=axes[0].tolist(), label="exact match")
    fig.suptitle(f"Needle in a haystack: window {grid['window']}, {grid['n_per_cell']} needles per cell, trained on "
                 f"{grid['trained_context']}-token contexts (dashed line)\nhatched: the needle lies beyond the window "
                 f"reach n_layer x window; chance {grid['chance']:.2f}", y=1.08)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_conversion(plt, conv, path):
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [3, 1.3, 3]})
    names = ["base_transformer", "c_orthros_untrained", "a_orthros_converted", "b_transformer_cpt"]
    labels = ["base\n(N steps)", "(c) converted,\nuntrained", "(a) converted\n+M steps", "(b) base CPT\n+M steps"]
    rows = conv["lm"]["rows"]
    after = [rows[n]["val_loss_after"] for n in names]
    axes[0].bar(labels, [s["mean"] for s in after], yerr=errors(after), capsize=4,
                color=["gray", "tab:olive", "tab:green", "tab:blue"])
    lo = min(s["mean"] for s in after)
    n = len(conv["seeds"])
    axes[0].set(ylabel="val loss", ylim=(lo * 0.97, None),
                title=f"LM (N={conv['lm']['N']}, M={conv['lm']['M']}; mean ± std of {n} seed{'s' * (n > 1)})")
    axes[0].tick_params(axis="x", labelsize=8)
    # Each seed's (a) and (b) share a base and the evaluation batches: their difference is paired.
    paired = next(c for c in conv["comparisons"] if (c["a"], c["b"]) == ("a_orthros_converted", "b_transformer_cpt"))
    axes[1].scatter([0] * len(paired["per_seed_diffs"]), paired["per_seed_diffs"], color="tab:green", zorder=3)
    axes[1].axhline(0, color="black", lw=1)
    axes[1].set(xticks=[], xlim=(-1, 1), ylabel="val loss difference",
                title="(a) - (b), per seed\n(< 0: conversion wins)")
    recall_rows = conv["recall"]["rows"]
    for name, label in zip(names[1:], labels[1:]):
        acc = recall_rows[name]["exact_match"]
        axes[2].plot(range(len(acc)), [a["accuracy"] for a in acc.values()], marker="o", label=label.replace("\n", " "))
        axes[2].set_xticks(range(len(acc)), list(acc), rotation=30)
    axes[2].set(ylabel="exact match", ylim=(min(0.8, axes[2].get_ylim()[0]), 1.01),
                title=f"recall (N={conv['recall']['N']}, M={conv['recall']['M']})")
    axes[2].legend(fontsize=7), fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_inference(plt, inf, path):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    models = list(dict.fromkeys(r["model"] for r in inf["rows"]))
    decoders = list(dict.fromkeys(r["decoder"] for r in inf["rows"]))
    width = 0.8 / len(decoders)
    for k, decoder in enumerate(decoders):
        by_model = {r["model"]: r for r in inf["rows"] if r["decoder"] == decoder}
        x = [i + (k - (len(decoders) - 1) / 2) * width for i in range(len(models))]
        axes[0].bar(x, [by_model[m]["ttft_ms"] for m in models], width, label=decoder)
        axes[1].bar(x, [by_model[m]["decode_tokens_per_s"] or 0 for m in models], width, label=decoder)
    axes[0].set(ylabel="ms", title=f"time to first token ({inf['rows'][0]['prompt_tokens']}-token prompt)")
    axes[1].set(ylabel="tokens/s", title=f"decode (batch {inf['rows'][0]['batch']})")
    for ax in axes:
        ax.set_xticks(range(len(models)), models, rotation=20)
        ax.legend(title="decoder", fontsize=7)
    fig.tight_layout(), fig.savefig(path, dpi=120)


def plot_gap(plt, gap, path):
    fig, axes = plt.subplots(1, len(gap["groups"]), figsize=(5 * len(gap["groups"]), 3.8), squeeze=False)
    for ax, group in zip(axes[0], gap["groups"]):
        for i, model in enumerate(gap["groups"][group][3]):
            runs = [r for name, r in gap["runs"].items() if name.startswith(f"{group}/{model} ")]
            n = min((len(r["steps"]) for r in runs), default=0)  # the steps every seed reached
            if n < 2:
                continue
            for key, style in (("val", "-"), ("train", "--")):
                mean = [statistics.fmean(r[key][j] for r in runs) for j in range(1, n)]
                ax.plot(runs[0]["steps"][1:n], mean, style, color=f"C{i}", marker=".",
                        label=f"{model} {key} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        ax.set(xlabel="step", ylabel="loss (nats per character or byte)", title=group)
        ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.suptitle(f"Orthros and the Transformer by regime, mean over seeds ({gap['meta']['device']})")
    fig.tight_layout(), fig.savefig(path, dpi=120)


PLOTS = {"lm": (plot_lm, "lm_val_loss"), "recall": (plot_recall, "recall_by_distance"), "niah": (plot_niah, "niah"),
         "conversion": (plot_conversion, "conversion"), "inference": (plot_inference, "inference"),
         "gap": (plot_gap, "gap")}


def step_plots(S):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    suffix = "" if S["name"] == "gpu" else f"_{S['name']}"
    for name, (plot, png) in PLOTS.items():
        path = RESULTS / f"{name}{suffix}.json"
        if path.exists():
            plot(plt, read_json(path), RESULTS / f"{png}{suffix}.png")
            plt.close("all")
            print(f"wrote {RESULTS / f'{png}{suffix}.png'}")


STEPS = {"lm": step_lm, "recall": step_recall, "niah": step_niah, "conversion": step_conversion,
         "inference": step_inference, "gap": step_gap, "plots": step_plots}


def main(argv=None):
    t_start = time.time()
    os.chdir(REPO)  # the commands it runs (train.py, sample.py), results/ and out/ are the repository's
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="+", choices=[*STEPS, "all"])
    parser.add_argument("--scale", default="gpu", choices=list(SCALES))
    parser.add_argument("--seeds", type=int, default=1, help="seeds for lm and conversion: 1337, 1338, ...")
    parser.add_argument("--parallel", type=int, default=0,
                        help="trainings at once (default 0: all of a step's at once on a GPU, one by one otherwise)")
    parser.add_argument("--time_limit", type=float, default=None, metavar="SECONDS",
                        help="stop the trainings (they save checkpoints) after this many seconds; rerun to continue")
    parser.add_argument("--results", default="results", metavar="DIR",
                        help="where the JSON files go (default: results)")
    args = parser.parse_args(argv)
    global RESULTS
    RESULTS = Path(args.results)
    if args.seeds < 1 or args.parallel < 0:
        parser.error("--seeds must be >= 1 and --parallel >= 0")
    S = {"name": args.scale, **SCALES[args.scale], "seeds": args.seeds, "out": Path("out") / f"exp-{args.scale}",
         "parallel": args.parallel or (0 if pick_device() == "cuda" else 1),
         "deadline": None if args.time_limit is None else t_start + args.time_limit}
    for name in (list(STEPS) if "all" in args.steps else args.steps):
        t0 = time.time()
        STEPS[name](S)
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
