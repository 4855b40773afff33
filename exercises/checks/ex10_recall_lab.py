"""Exercise 10, the recall lab: the checker. The reference: the stored solution."""

import contextlib
import json
import random
import tempfile
from pathlib import Path

from checkpoint import load_checkpoint, save_checkpoint
from data.prepare_utils import find_dataset
from exercises.framework import REPO, Domain, NotReady, difference
from exercises.solutions import ex10_recall_lab as solution

TITLE, DIFFICULTY, MINUTES = "The recall lab", 4, 30
FUNCTIONS = ("recall_summary",)
REFERENCE = solution   # the stored solution: its functions
PAPER = "window=128, n_layer=12"
DEFAULT_RUNS = {"swa": "out/lab-recall-swa", "orthros": "out/lab-recall-orthros"}
COMMANDS = "\n    ".join(f"python train.py --config recall_tiny --attn {attn} --out_dir {out}"
                         for attn, out in DEFAULT_RUNS.items())
FOLDER = tempfile.TemporaryDirectory(prefix="orthros-lab-")   # the made-up runs, removed at exit
SWA_ABOVE_CHANCE, ORTHROS_BEYOND = 0.25, 0.6
RETRAIN = "Let it train its whole schedule (recall_tiny's 2400 steps), or again with another seed."


def made_up_run(seed, attn, window, n_layer, cut, path, **_):
    """A run's folder: exact_match.json (buckets cut near w, n_layer * w, at random), a ckpt"""
    window, n_layer = window + seed, n_layer + seed   # seed 1: another run in the same folder
    rng, reach, run = random.Random(seed), n_layer * window, Path(tempfile.mkdtemp(dir=FOLDER.name))
    drop = {window, reach} - {2} if cut == "across" else set()   # then a bucket across each
    cuts = sorted({1, max(2, window - 1), window, window + 1, reach - 1, reach, reach + 1,
                   2 * reach + 1, *(rng.randrange(2, 2 * reach + 1) for _ in range(3))} - drop)
    n = {f"{lo}-{hi}": rng.choice([1, 37, 100, 300]) for lo, hi in zip(cuts, cuts[1:])}
    buckets = {name: {"n": n, "accuracy": rng.randint(0, n) / n} for name, n in n.items()}
    buckets["1-" + str(cuts[1])].update(n=100, accuracy=0.29)   # 0.29 * 100 = 28.999999999999996
    (run / "exact_match.json").write_text(json.dumps(buckets))
    config = dict(attn=attn, window=window, n_layer=n_layer, n_head=n_layer + 1)
    save_checkpoint(run / "ckpt_last.pt", model_config=config, step=0)
    return dict(run_dir=str(run) if path == "str" else run)


DOMAIN = {"recall_summary": Domain(
    made_up_run, pairs=[("path", "attn"), ("cut", "window")], attn=["swa", "orthros"],
    cut=["at the window and the reach", "across"], window=[2, 3, 4, 8, 32, 128],
    n_layer=lambda window: [12] if window == 128 else [1, 2, 3, 4], path=["str", "pathlib.Path"])}


def trained_runs(answer, runs=None, **options):
    """your summaries of your two trained runs, and what they show"""
    for attn in ("swa", "orthros"):
        path = trained_run(runs, attn)
        mine, guess = answer.recall_summary(path), chance(path)
        beyond, where = mine["beyond"], f"recall_summary({str(path)!r}), your trained {attn} run"
        problem = difference(mine, solution.recall_summary(path), "your summary") or (
            f"{path} holds an {mine['attn']!r} run, not {attn!r}" if mine["attn"] != attn else
            f"SWA answers {beyond:.2f} beyond n_layer * window (chance is {guess or '?'}): it "
            "should not reach that far. Is it a sliding-window model, trained on recall?"
            if attn == "swa" and beyond > (guess or 0.05) + SWA_ABOVE_CHANCE else
            f"Orthros answers only {beyond:.2f} beyond n_layer * window. {RETRAIN}"
            if attn == "orthros" and beyond < ORTHROS_BEYOND else None)
        if problem:
            return f"{where}: {problem}"


PROPERTIES = [trained_runs]


def trained_run(runs, attn):
    path = Path(str((runs or {}).get(attn) or DEFAULT_RUNS[attn]))
    path = path if path.is_absolute() or runs else REPO / path
    if not (path / "exact_match.json").is_file() or not (path / "ckpt_last.pt").is_file():
        raise NotReady(f"waiting for its runs: no {attn} run at {path} yet. Train both (3-4 min. "
                       f"each on 2 idle CPU cores), from the repo root:\n    {COMMANDS}\nthen "
                       "check again (or point it at your runs: --runs swa=DIR,orthros=DIR).")
    return path


def chance(path):
    """1 / the number of values of the run's recall task, from its dataset's meta.json (or None)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        dataset = str(load_checkpoint(path / "ckpt_last.pt")["dataset"])
        meta = json.loads((find_dataset(dataset, prepare=False) / "meta.json").read_text())
        return 1 / meta["params"]["n_values"]


def after_pass(answer, runs=None, **options):
    guess = chance(trained_run(runs, "swa"))
    lines = [f"Exact match by distance (your runs; chance is "
             f"{'unknown' if guess is None else f'{guess:.2f}'}):"]
    for attn in ("swa", "orthros"):
        path = trained_run(runs, attn)
        s, scores = answer.recall_summary(path), json.loads((path / "exact_match.json").read_text())
        poor = f"; NOTE: poor even inside its window. {RETRAIN}" * (s["inside"] < 0.6)
        accuracies = "  ".join(f"{b} {r['accuracy']:.2f}" for b, r in scores.items())
        lines += [f"  {attn:>8}: {accuracies}",
                  f"  {'':>8}  inside the window (w={s['window']}): {s['inside']:.2f};  beyond "
                  f"n_layer * w = {s['n_layer'] * s['window']}: {s['beyond']:.2f}{poor}"]
    return "\n".join(lines)
