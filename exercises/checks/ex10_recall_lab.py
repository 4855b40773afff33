"""Exercise 10, the recall lab: the checker."""

import contextlib
import json
import tempfile
from pathlib import Path

from checkpoint import load_checkpoint, save_checkpoint
from data.prepare_utils import find_dataset
from exercises.framework import REPO, Bug, Case, Mutant, NotReady, Wrong, short
from exercises.solutions import ex10_recall_lab as solution

TITLE, DIFFICULTY, MINUTES = "The recall lab", 4, 30
FUNCTIONS = ("recall_summary",)
REFERENCE = solution   # the stored solution: its functions
PAPER = "w=128, 12 layers"

COMMANDS = ("python train.py --config recall_tiny --attn swa --out_dir out/lab-recall-swa\n"
            "    python train.py --config recall_tiny --attn orthros --out_dir out/lab-recall-orthros")
DEFAULT_RUNS = {"swa": "out/lab-recall-swa", "orthros": "out/lab-recall-orthros"}

HINTS = [
    "Two files tell you everything: the checkpoint's model_config (the window w and the number of layers L, which the "
    "run's command line set through --config) and exact_match.json ({bucket: {'n', 'accuracy'}}). A bucket 'lo-hi' "
    "holds the distances lo <= d < hi. One SWA layer reaches w-1 positions back, L layers about L*w: beyond that, SWA "
    "can only guess.",
    "1. the model config: the checkpoint ckpt_last.pt in run_dir, read with checkpoint.load_checkpoint; its "
    "'model_config' is a dict with 'attn', 'window', 'n_layer'\n"
    "2. the scores: exact_match.json in run_dir, a dict {'lo-hi': {'n': examples, 'accuracy': fraction}}\n"
    "3. for a set of buckets: hits = the sum of accuracy * n, examples = the sum of n; the pooled accuracy is hits / "
    "examples\n"
    "4. inside: the buckets whose hi <= w; beyond: those whose lo >= n_layer * w\n"
    "5. return the five keys the docstring names",
    "Paper, section 4.4 (in-context recall) and Table 3: Orthros keeps Transformer-level recall while SWA loses it; "
    "section 3.1: the output tokens' full cross-attention is what 'retrieve[s] global information'. In the repo: "
    "README, 'In-context recall'.",
]

REACH = ', config["n_layer"] * config["window"]'
POOLED = 'sum(r["accuracy"] * r["n"] for r in chosen)'
BUGS = [
    Bug("beyond the window w, not beyond n_layer * window", "a sliding-window model chains its layers: with L layers it "
        "still reaches about L*w back, so buckets between w and L*w are not out of its reach.", {REACH: ', config["window"]'}),
    Bug("the mean of the buckets' accuracies, not pooled over examples", "buckets hold different numbers of examples: "
        "pool the hits (accuracy * n) and divide by the total n.",
        {f'{POOLED} / sum(r["n"] for r in chosen)': 'sum(r["accuracy"] for r in chosen) / len(chosen)'}),
    Bug("buckets that merely start inside the window counted as inside", "a bucket 'lo-hi' is inside the window only if "
        "all its distances are, hi <= w.", {"lambda lo, hi: hi <= w": "lambda lo, hi: lo < w"}),
]
MUTANTS = [
    Mutant("hits truncated by int()", "each bucket's hits truncated by int()", {POOLED: 'sum(int(r["accuracy"] * r["n"]) for r in chosen)'}),
    Mutant("recall_tiny's window hard-coded (32) for inside", "of the buckets 1-3, 3-4, 4-5, 5-6, 6-7, 7-8, 8-16;", {"hi <= w)": "hi <= 32)"}),
    Mutant("n_layer read from n_head", "of the buckets 16-33", {REACH: ', config["n_head"] * config["window"]'}),
    Mutant("beyond: lo > n_layer * window", "of the buckets 16-33", {"lo >= reach": "lo > reach"}),
    Mutant("inside: hi < window", "of the buckets 1-3; the reference pools the buckets with hi <= window = 4", {"hi <= w)": "hi < w)"}),
    Mutant("exercise 6's reach, n_layer * (window - 1)", "of the buckets 6-7, 7-8, 8-16, 16-33;",
           {REACH: ', config["n_layer"] * (config["window"] - 1)'}),
    Mutant("inside: hi - 1 <= window", "of the buckets 1-3, 3-4, 4-5;", {"hi <= w)": "hi - 1 <= w)"}),
    Mutant("beyond: lo > n_layer * (window - 1)", "of the buckets 7-8, 8-16, 16-33;",
           {"lo >= reach)": 'lo > config["n_layer"] * (w - 1))'}),
    Mutant("attn guessed from the folder's name", "at ['attn']: yours 'orthros', the reference 'swa'",
           {'"attn": config["attn"]': '"attn": "swa" if "swa" in str(run_dir) else "orthros"'}),
    Mutant("the stored solution imported", "is not available to your code",
           source="def recall_summary(run_dir):\n    from exercises.solutions.ex10_recall_lab import recall_summary\n"
                  "    return recall_summary(run_dir)\n"),
]


# Made-up runs (attn, w, L, H, buckets): L != H; a bucket at each distance from w to L w (where rules a step off near w, or
# L off near L w, differ), one across w; hits that truncate under int() (0.29 * 100 = 28.999...); the paper's w and L.
MADE_UP = [("swa", 4, 2, 4, {"1-3": (100, 0.97), "3-4": (100, 0.9), "4-5": (100, 0.6), "5-6": (100, 0.5), "6-7": (100, 0.3),
                             "7-8": (100, 0.2), "8-16": (50, 0.1), "16-33": (150, 0.04)}),
           ("swa", 3, 4, 2, {"1-2": (100, 0.29), "2-4": (100, 0.57), "4-5": (100, 0.58), "5-12": (300, 0.11),
                             "12-20": (100, 0.07), "20-41": (100, 0.29)}),
           ("orthros", 8, 3, 2, {"1-8": (40, 1.0), "8-16": (100, 0.9), "16-32": (120, 0.95), "32-64": (60, 0.75),
                                 "64-99": (20, 0.5)}),
           ("orthros", 128, 12, 6, {"1-128": (300, 0.99), "128-256": (300, 0.98), "256-512": (300, 0.97), "512-1024": (300, 0.58),
                                    "1024-1536": (300, 0.57), "1536-2048": (300, 0.29), "2048-4097": (300, 0.56)})]
SWA_ABOVE_CHANCE, ORTHROS_BEYOND = 0.25, 0.6
POOLINGS = [("yours is the pooled accuracy of the buckets {}", lambda a, n: sum(x * m for x, m in zip(a, n)) / sum(n)),
            ("yours pools the buckets {} with each bucket's hits truncated by int()",
             lambda a, n: sum(int(x * m) for x, m in zip(a, n)) / sum(n)),
            ("yours is the mean of the accuracies of the buckets {}, not pooled over examples", lambda a, n: sum(a) / len(a))]
RETRAIN = "Let it train its whole schedule (recall_tiny's 2400 steps), or train it again with another --seed."


def made_up_run(folder, i):
    """Write made-up run i: its exact_match.json, and a checkpoint that holds only (part of) a model config."""
    attn, w, L, H, buckets = MADE_UP[i]
    run = Path(folder) / f"run{i}"
    run.mkdir(exist_ok=True)
    (run / "exact_match.json").write_text(json.dumps({b: {"n": n, "accuracy": a} for b, (n, a) in buckets.items()}))
    save_checkpoint(run / "ckpt_last.pt", model_config=dict(attn=attn, window=w, n_layer=L, n_head=H), step=0)
    return str(run)


def cases(runs=None, **options):
    folder = tempfile.TemporaryDirectory(prefix="orthros-lab-")   # removed when the last case is gone
    for i, (attn, w, L, H, buckets) in enumerate(MADE_UP):
        yield Case(f"recall_summary(run_dir) for a made-up {attn} run (w={w}, {L} layers, {H} heads): {buckets}",
                   lambda i=i: dict(run_dir=made_up_run(folder.name, i)), explained, output="your summary",
                   invariant="inside: the examples of the buckets with hi <= window; beyond: those of the buckets with lo >= "
                             "n_layer * window; each pooled over examples (the stored solution, run on the same files)")
    for attn in ("swa", "orthros"):
        trained = lambda attn=attn: dict(run_dir=str(trained_run(runs, attn)))
        yield Case(f"recall_summary({run_dir(runs, attn)!r}), your trained {attn} run", trained, explained,
                   "the stored solution's summary of the same run", output="your summary")
        yield Case(f"what the {attn} run shows (your recall_summary of {run_dir(runs, attn)})", trained,
                   lambda answer, run_dir: (answer.recall_summary(run_dir), Path(run_dir)), output="your summary and the run",
                   invariant=f"SWA is near chance beyond n_layer * window (at most chance + {SWA_ABOVE_CHANCE}); Orthros answers "
                             f"there (at least {ORTHROS_BEYOND})", holds=lambda shown, attn=attn: claim(attn, *shown))


def explained(answer, run_dir):
    """The answer's summary; when its config values are right but a pooled accuracy is not, which buckets and which way
    of pooling give the answer's number."""
    mine, right = answer.recall_summary(run_dir), solution.recall_summary(run_dir)
    if not isinstance(mine, dict) or any(mine.get(key) != right[key] for key in ("attn", "window", "n_layer")):
        return mine   # the framework names the first key that differs
    scores = json.loads((Path(run_dir) / "exact_match.json").read_text())
    w, reach = right["window"], right["n_layer"] * right["window"]
    for key, keep, rule in (("inside", lambda lo, hi: hi <= w, f"hi <= window = {w}"),
                            ("beyond", lambda lo, hi: lo >= reach, f"lo >= n_layer * window = {reach}")):
        value, chosen = mine.get(key), [b for b in scores if keep(*map(int, b.split("-")))]
        if isinstance(value, float) and abs(value - right[key]) > 1e-12:
            raise Wrong(f"at [{key!r}]: yours {short(value)}, the reference {short(right[key])}: {which_buckets(value, scores, chosen)}"
                        f"; the reference pools the buckets with {rule}: {', '.join(chosen)}")
    return mine


def which_buckets(value, scores, chosen):
    """Which buckets (the reference's, the first or the last ones), pooled which way, give value, in words."""
    names = list(scores)
    for buckets in [chosen] + [names[:i] for i in range(1, len(names) + 1)] + [names[i:] for i in range(len(names))]:
        a, n = [scores[b]["accuracy"] for b in buckets], [scores[b]["n"] for b in buckets]
        for words, pooled in POOLINGS:
            if abs(pooled(a, n) - value) <= 1e-12:
                return words.format(", ".join(buckets))
    return "no run of buckets, pooled or averaged, gives your number"


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
