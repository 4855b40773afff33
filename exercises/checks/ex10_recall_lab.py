"""Exercise 10, the recall lab: the checker, hints and known bugs."""

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

from data.recall.prepare import PRESETS
from exercises.framework import REPO, Bug, Case, NotReady
from sample import load_checkpoint
from train import save_checkpoint
from exercises.solutions import ex10_recall_lab as solution

TITLE = "The recall lab"
DIFFICULTY = 4
MINUTES = 30
TEACHES = "train SWA and Orthros on CPU: SWA is at chance beyond n_layer*w, Orthros answers far queries; read runs live"
FUNCTIONS = ("recall_summary",)
REFERENCE = SimpleNamespace(recall_summary=solution.recall_summary)
RETURNS = {"recall_summary": "summary"}

COMMANDS = ("python train.py --config recall_tiny --attn swa --out_dir out/lab-recall-swa\n"
            "    python train.py --config recall_tiny --attn orthros --out_dir out/lab-recall-orthros")
DEFAULT_RUNS = {"swa": "out/lab-recall-swa", "orthros": "out/lab-recall-orthros"}

HINTS = [
    "Two files tell you everything: the checkpoint's model_config (the window w and the number of layers L, "
    "which the run's command line set through --config) and exact_match.json ({bucket: {'n', 'accuracy'}}). "
    "A bucket 'lo-hi' holds the distances lo <= d < hi. One SWA layer reaches w-1 positions back, L layers "
    "about L*w: beyond that, SWA can only guess.",
    "1. the model config: the checkpoint ckpt_last.pt in run_dir, read with sample.load_checkpoint; its "
    "'model_config' is a dict with 'attn', 'window', 'n_layer'\n"
    "2. the scores: exact_match.json in run_dir, a dict {'lo-hi': {'n': examples, 'accuracy': fraction}}\n"
    "3. for a set of buckets: hits = the sum of accuracy * n, examples = the sum of n; the pooled accuracy "
    "is hits / examples\n"
    "4. inside: the buckets whose hi <= w; beyond: those whose lo >= n_layer * w\n"
    "5. return the five keys the docstring names",
    "Paper, section 4.4 (in-context recall) and Table 3: Orthros keeps Transformer-level recall while SWA "
    "loses it; section 3.1: the output tokens' full cross-attention is what 'retrieve[s] global information'. "
    "In the repo: README, 'In-context recall'.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(beyond_window=False, mean=False, starts_inside=False):
    def recall_summary(run_dir):
        config = load_checkpoint(Path(run_dir) / "ckpt_last.pt")["model_config"]
        scores = json.loads((Path(run_dir) / "exact_match.json").read_text())
        w = config["window"]
        reach = w if beyond_window else config["n_layer"] * w

        def pooled(keep):
            chosen = [r for name, r in scores.items() if keep(*map(int, name.split("-")))]
            if mean:
                return sum(r["accuracy"] for r in chosen) / len(chosen)
            return sum(r["accuracy"] * r["n"] for r in chosen) / sum(r["n"] for r in chosen)

        inside = (lambda lo, hi: lo < w) if starts_inside else (lambda lo, hi: hi <= w)
        return {"attn": config["attn"], "window": w, "n_layer": config["n_layer"],
                "inside": pooled(inside), "beyond": pooled(lambda lo, hi: lo >= reach)}
    return SimpleNamespace(recall_summary=recall_summary)


BUGS = [
    Bug("beyond the window w, not beyond n_layer * window", "a sliding-window model chains its layers: with L "
        "layers it still reaches about L*w back, so buckets between w and L*w are not out of its reach.",
        make_bug(beyond_window=True)),
    Bug("the mean of the buckets' accuracies, not pooled over examples", "buckets hold different numbers of "
        "examples: pool the hits (accuracy * n) and divide by the total n.", make_bug(mean=True)),
    Bug("buckets that merely start inside the window counted as inside", "a bucket 'lo-hi' is inside the "
        "window only if all its distances are, hi <= w.", make_bug(starts_inside=True)),
]


# -- Cases --------------------------------------------------------------------------------------

MADE_UP = {  # name: (model config, {bucket: (n, accuracy)})
    "a made-up SWA run (w=4, 2 layers)": (
        {"attn": "swa", "window": 4, "n_layer": 2},
        {"1-3": (100, 0.97), "3-6": (100, 0.55), "6-8": (100, 0.21), "8-16": (50, 0.1), "16-33": (150, 0.04)}),
    "a made-up Orthros run (w=8, 3 layers)": (
        {"attn": "orthros", "window": 8, "n_layer": 3},
        {"1-8": (40, 1.0), "8-16": (100, 0.9), "16-32": (120, 0.95), "32-64": (60, 0.75), "64-99": (20, 0.5)}),
}


def make_up_runs(folder):
    """Write the made-up runs: exact_match.json and checkpoints that hold only a model config."""
    runs = {}
    for i, (name, (config, buckets)) in enumerate(MADE_UP.items()):
        run = Path(folder) / f"run{i}"
        run.mkdir()
        (run / "exact_match.json").write_text(json.dumps({b: {"n": n, "accuracy": a} for b, (n, a) in buckets.items()}))
        for ckpt in ("ckpt_last.pt", "ckpt_best.pt"):
            save_checkpoint(run / ckpt, model_config=config, step=0)
        runs[name] = run
    return runs


def cases(runs=None, **options):
    folder = tempfile.TemporaryDirectory(prefix="orthros-lab-")  # removed when the last case is gone
    found = [Case(f"recall_summary(run_dir) for {name}: {MADE_UP[name][1]}",
                  inputs=lambda run=run, folder=folder: dict(run_dir=str(run)),
                  call=lambda answer, run_dir: answer.recall_summary(run_dir),
                  invariant="inside: the examples of the buckets with hi <= window; beyond: those of the buckets "
                            "with lo >= n_layer * window; each pooled over examples (the stored solution, run on "
                            "the same files)",
                  atol=1e-12)
             for name, run in make_up_runs(folder.name).items()]
    chance = 1 / PRESETS["tiny"]["n_values"]
    for attn, claim in (("swa", lambda s: swa_claim(s, chance)), ("orthros", orthros_claim)):
        found.append(Case(f"recall_summary({run_dir(runs, attn)!r}), your trained {attn} run",
                          inputs=lambda attn=attn: dict(run_dir=str(trained_run(runs, attn))),
                          call=lambda answer, run_dir: answer.recall_summary(run_dir),
                          invariant="the stored solution's summary of the same run", atol=1e-12))
        found.append(Case(f"what the {attn} run shows (your recall_summary of {run_dir(runs, attn)})",
                          inputs=lambda attn=attn: dict(run_dir=str(trained_run(runs, attn))),
                          call=lambda answer, run_dir: (answer.recall_summary(run_dir), Path(run_dir)),
                          invariant="SWA is near chance (1/26) beyond n_layer * window (at most 0.3); Orthros "
                                    "answers there (at least 0.6), as tests/test_train.py asserts",
                          holds=claim, output="your summary and the run"))
    return found


def run_dir(runs, attn):
    return str((runs or {}).get(attn) or DEFAULT_RUNS[attn])


def trained_run(runs, attn):
    path = Path(run_dir(runs, attn))
    path = path if path.is_absolute() or runs else REPO / path
    if not (path / "exact_match.json").is_file() or not (path / "ckpt_last.pt").is_file():
        raise NotReady(f"waiting for its runs: the lab's {attn} run is not there yet (no {path}/exact_match.json). Train "
                       f"both runs (about 2 minutes each on 2 idle CPU cores), from the repo root:\n    {COMMANDS}\n"
                       "then run this check again (or point it at your runs: --runs swa=DIR,orthros=DIR).")
    return path


def swa_claim(summary_and_path, chance):
    summary, path = summary_and_path
    if summary["attn"] != "swa":
        return f"{path} holds an {summary['attn']!r} run, not 'swa'"
    if summary["beyond"] > 0.3:
        return (f"SWA answers {summary['beyond']:.2f} beyond n_layer * window (chance is {chance:.2f}): it should "
                "not reach that far. Is this run's window the recall_tiny one?")
    return None


def orthros_claim(summary_and_path):
    summary, path = summary_and_path
    if summary["attn"] != "orthros":
        return f"{path} holds an {summary['attn']!r} run, not 'orthros'"
    if summary["beyond"] < 0.6:
        return f"Orthros answers only {summary['beyond']:.2f} beyond n_layer * window. {schedule(path, summary['attn'])}"
    return None


def schedule(path, attn):
    ckpt = load_checkpoint(path / "ckpt_last.pt")
    step, max_iters = ckpt["step"], ckpt["train_config"]["max_iters"]
    if max_iters < 2400 or step < max_iters:
        return (f"Its checkpoint is at step {step} of max_iters {max_iters}: train with the recall_tiny config's "
                "full 2400-step schedule (shorter ones did not learn recall in our tries).")
    return (f"It trained the full schedule ({step} steps): read its log ({path / 'log.jsonl'}) for the loss, and "
            f"train it again (python train.py --config recall_tiny --attn {attn} --out_dir {path} --overwrite true, "
            "with another --seed if the loss stalled).")


def after_pass(answer, runs=None, **options):
    chance = 1 / PRESETS["tiny"]["n_values"]
    lines = [f"Exact match by distance (your runs; chance is 1/{PRESETS['tiny']['n_values']} = {chance:.2f}):"]
    for attn in ("swa", "orthros"):
        path = trained_run(runs, attn)
        summary = answer.recall_summary(path)
        scores = json.loads((path / "exact_match.json").read_text())
        lines.append(f"  {attn:>8}: " + "  ".join(f"{b} {r['accuracy']:.2f}" for b, r in scores.items()))
        lines.append(f"  {'':>8}  inside the window (w={summary['window']}): {summary['inside']:.2f};  beyond "
                     f"n_layer * w = {summary['n_layer'] * summary['window']}: {summary['beyond']:.2f}")
        if summary["inside"] < 0.6:
            lines.append(f"  {'':>8}  NOTE: this run answers only {summary['inside']:.2f} inside its window, where "
                         f"the model can reach the key: it learned the task poorly. {schedule(path, attn)}")
    return "\n".join(lines)
