"""Exercise 10, the recall lab: the checker. The reference is the stored solution, on made-up runs and on yours."""

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

COMMANDS = ("python train.py --config recall_tiny --attn swa --out_dir out/lab-recall-swa\n"
            "    python train.py --config recall_tiny --attn orthros --out_dir out/lab-recall-orthros")
DEFAULT_RUNS = {"swa": "out/lab-recall-swa", "orthros": "out/lab-recall-orthros"}


FOLDER = tempfile.TemporaryDirectory(prefix="orthros-lab-")   # the made-up runs, removed at exit
SWA_ABOVE_CHANCE, ORTHROS_BEYOND = 0.25, 0.6
RETRAIN = "Let it train its whole schedule (recall_tiny's 2400 steps), or train it again with another --seed."


def made_up_run(seed, attn, window, n_layer, path, **_):
    """A run's folder: exact_match.json with buckets "lo-hi" cut at every distance next to the window and to n_layer *
    window and at random ones, of random sizes and hits; a checkpoint holding only a model config."""
    window, n_layer = window + seed, n_layer + seed   # seed 1: another run written into the same folder
    rng, reach = random.Random(seed), n_layer * window
    cuts = sorted({1, window, window + 1, reach - 1, reach, reach + 1, 2 * reach + 1, *(rng.randrange(2, 2 * reach + 1) for _ in range(3))})
    run = Path(tempfile.mkdtemp(dir=FOLDER.name))
    n = {f"{lo}-{hi}": rng.choice([1, 37, 100, 300]) for lo, hi in zip(cuts, cuts[1:])}
    buckets = {name: {"n": n, "accuracy": rng.randint(0, n) / n} for name, n in n.items()}   # hits / n
    buckets[min(buckets)].update(n=100, accuracy=0.29)   # 0.29 * 100 = 28.999999999999996
    (run / "exact_match.json").write_text(json.dumps(buckets))
    save_checkpoint(run / "ckpt_last.pt", model_config=dict(attn=attn, window=window, n_layer=n_layer, n_head=n_layer + 1),
                    step=0)
    return dict(run_dir=str(run) if path == "str" else run)


DOMAIN = {"recall_summary": Domain(made_up_run, pairs=[("window", "n_layer"), ("path", "attn")], attn=["swa", "orthros"],
                                   window=[2, 3, 4, 8, 32, 128], n_layer=[1, 2, 3, 4, 12], path=["str", "pathlib.Path"])}


def trained_runs(answer, runs=None, **options):
    """your summaries of your two trained runs, and what they show"""
    for attn in ("swa", "orthros"):
        path = trained_run(runs, attn)
        mine = answer.recall_summary(path)
        problem = difference(mine, solution.recall_summary(path), "your summary") or claim(attn, mine, path)
        if problem:
            return f"recall_summary({str(path)!r}), your trained {attn} run: {problem}"


PROPERTIES = [trained_runs]


def run_dir(runs, attn):
    return str((runs or {}).get(attn) or DEFAULT_RUNS[attn])


def trained_run(runs, attn):
    path = Path(run_dir(runs, attn))
    path = path if path.is_absolute() or runs else REPO / path
    if not (path / "exact_match.json").is_file() or not (path / "ckpt_last.pt").is_file():
        raise NotReady(f"waiting for its runs: the lab's {attn} run is not there yet (no {path}/exact_match.json). Train both runs "
                       f"(3-4 minutes each on 2 idle CPU cores), from the repo root:\n    {COMMANDS}\nthen run this check again "
                       "(or point it at your runs: --runs swa=DIR,orthros=DIR).")
    return path


def chance(path):
    """1 / the number of values of the run's recall task, from its dataset's meta.json (None if it is gone)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        meta = find_dataset(str(load_checkpoint(path / "ckpt_last.pt")["dataset"]), prepare=False) / "meta.json"
        return 1 / json.loads(meta.read_text())["params"]["n_values"]


def claim(attn, summary, path):
    """What the run must show: SWA near chance beyond n_layer * window, Orthros answering there."""
    guess = chance(path)
    if summary["attn"] != attn:
        return f"{path} holds an {summary['attn']!r} run, not {attn!r}"
    if attn == "swa" and summary["beyond"] > (guess or 0.05) + SWA_ABOVE_CHANCE:
        return (f"SWA answers {summary['beyond']:.2f} beyond n_layer * window (chance is {guess or 'unknown'}): it should not "
                "reach that far. Is this the run of a sliding-window model, trained on the recall task?")
    if attn == "orthros" and summary["beyond"] < ORTHROS_BEYOND:
        return f"Orthros answers only {summary['beyond']:.2f} beyond n_layer * window. {RETRAIN}"
    return None


def after_pass(answer, runs=None, **options):
    guess = chance(trained_run(runs, "swa"))
    lines = [f"Exact match by distance (your runs; chance is {'unknown' if guess is None else f'{guess:.2f}'}):"]
    for attn in ("swa", "orthros"):
        path = trained_run(runs, attn)
        summary, scores = answer.recall_summary(path), json.loads((path / "exact_match.json").read_text())
        reach, poor = summary["n_layer"] * summary["window"], f"; NOTE: poor even inside its window. {RETRAIN}"
        lines += [f"  {attn:>8}: " + "  ".join(f"{b} {r['accuracy']:.2f}" for b, r in scores.items()),
                  f"  {'':>8}  inside the window (w={summary['window']}): {summary['inside']:.2f};  beyond n_layer * w = "
                  f"{reach}: {summary['beyond']:.2f}" + (poor if summary["inside"] < 0.6 else "")]
    return "\n".join(lines)
