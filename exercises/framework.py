"""The checker every exercise shares: cases run live against the real code, the smallest failing
case reported with its largest difference and the invariant it breaks, known mistakes named.

An exercise's checks module (exercises/checks/exNN_*.py) declares:
  TITLE, DIFFICULTY (1-5), MINUTES, TEACHES   for the syllabus
  FUNCTIONS    the names the student writes in exercises/exNN_*.py
  REFERENCE    a namespace of the right functions: orthros.py's (or bench.py's) own for a
               "replace" exercise, a stored solution (exercises/solutions/) for a "build" one
  HINTS        the idea, then the shapes or pseudocode, then the paper's line
  BUGS         known-bug versions: copies of the reference with one classic mistake
  cases(**options)   the cases, smallest first
  after_pass(impl, **options)   optional: what to print once everything passes
check() runs the cases in order and stops at the first that fails: that is the smallest.
"""

import contextlib
import importlib
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Callable

import torch

import orthros

ORDER = ["ex01_window_mask", "ex02_two_streams", "ex03_t_out_regimes", "ex04_algorithm1", "ex05_conversion",
         "ex06_reach", "ex07_prefill_flops", "ex08_blocked_window", "ex09_decode_step", "ex10_recall_lab"]


@dataclass
class Case:
    what: str                          # the inputs, in words: the case a student re-runs by hand
    run: Callable                      # impl -> output; impl has the FUNCTIONS as attributes
    invariant: str                     # what the reference satisfies here, in words
    atol: float = 0.0                  # 0: exact (booleans, integers, copies)
    expected: Callable = None          # () -> the right output, when it is not run(REFERENCE)
    holds: Callable = None             # output -> None, or what is wrong: a property, no reference output


@dataclass
class Bug:
    name: str                          # the classic mistake, in a few words
    why: str                           # what it breaks
    impl: SimpleNamespace              # the reference's FUNCTIONS with the mistake in one of them


@dataclass
class Result:
    status: str                        # "PASS", "not started" or "FAIL"
    message: str = ""
    seconds: float = 0.0
    named: list = field(default_factory=list)   # the known bugs the answer behaves like


class NotReady(Exception):
    """Something the check needs is not there yet (e.g. the recall lab's trained runs)."""


class Raised:
    """An exception a case raised, kept as its output so that it can be compared and shown."""

    def __init__(self, error):
        self.error = error
        # the last line of a student's file that the error passed through, if any
        frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).name.startswith("ex")
                  and Path(f.filename).parent.name == "exercises"]
        self.where = f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""

    def __repr__(self):
        return f"raised {type(self.error).__name__}: {self.error}{self.where}"


# -----------------------------------------------------------------------------
# Loading an exercise

def load(n, solution=False):
    """(spec, impl): exercise n's checks module and the functions to check, the student's own
    (exercises/exNN_*.py) or, with solution=True, the reference."""
    name = ORDER[n - 1]
    spec = importlib.import_module(f"exercises.checks.{name}")
    if solution:
        return spec, spec.REFERENCE
    return spec, importlib.import_module(f"exercises.{name}")


def reference_kind(fn):
    """"replace" when the reference is the repo's own function, "build" when it is a stored solution."""
    return "build" if fn.__module__.startswith("exercises") else "replace"


def kind(spec):
    kinds = dict.fromkeys(reference_kind(getattr(spec.REFERENCE, name)) for name in spec.FUNCTIONS)
    return " + ".join(kinds)


def variant(reference, **changed):
    """The reference's functions with some replaced: a known-bug version."""
    return SimpleNamespace(**{**vars(reference), **changed})


# -----------------------------------------------------------------------------
# Running the cases

def check(spec, impl, **options):
    """Run spec's cases on impl, smallest first; stop at the first failure and name the known
    bugs that fail the same way. One thread: the models are tiny, and a second thread only waits
    (on a busy machine, e.g. while a recall run trains, it makes each forward ~100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_cases(spec, impl, **options)
    finally:
        torch.set_num_threads(threads)


def run_cases(spec, impl, **options):
    start = time.perf_counter()
    for name in spec.FUNCTIONS:  # a student file that imports the reference would pass: refuse it
        if isinstance(impl, ModuleType) and getattr(impl, name) is getattr(spec.REFERENCE, name):
            return Result("FAIL", f"FAIL. Your `{name}` is the reference itself (imported from "
                          f"{getattr(impl, name).__module__}): write your own.", time.perf_counter() - start)
    cases = spec.cases(**options)
    expected = {}  # case index -> the right output, computed once (bugs are compared with it too)
    for i, case in enumerate(cases):
        try:
            out = attempt(case, impl)
        except NotImplementedError as e:
            return Result("not started", not_started(e), time.perf_counter() - start)
        except NotReady as e:
            return Result("not started", str(e), time.perf_counter() - start)
        problem = judge(spec, cases, i, out, expected)
        if problem:
            named = [bug for bug in spec.BUGS if behaves_like(spec, bug, cases, i, out, expected)]
            return Result("FAIL", failure(case, out, expected.get(i), problem, named),
                          time.perf_counter() - start, [bug.name for bug in named])
    extra = spec.after_pass(impl, **options) if hasattr(spec, "after_pass") else ""
    return Result("PASS", extra, time.perf_counter() - start)


def attempt(case, impl):
    """case.run(impl); an exception (other than "not written yet") becomes the output."""
    try:
        return case.run(impl)
    except (NotImplementedError, NotReady):
        raise
    except Exception as e:  # the student's error is a result to report, not a crash of the checker
        return Raised(e)


def judge(spec, cases, i, out, expected):
    """None if out is right for case i, else what is wrong, in words."""
    case = cases[i]
    if case.holds:
        return f"your code {out!r}" if isinstance(out, Raised) else case.holds(out)
    if i not in expected:
        expected[i] = case.expected() if case.expected else case.run(spec.REFERENCE)
    return difference(out, expected[i], case.atol)


def behaves_like(spec, bug, cases, i, out, expected):
    """Does the bug pass every case before i, as the answer did, and fail case i the same way?"""
    for j in range(i + 1):
        try:
            bug_out = attempt(cases[j], bug.impl)
        except (NotImplementedError, NotReady):
            return False
        problem = judge(spec, cases, j, bug_out, expected)
        if j < i and problem:
            return False
    if cases[i].holds:
        return problem is not None
    return difference(bug_out, out, cases[i].atol) is None


# -----------------------------------------------------------------------------
# Differences, in words

def difference(out, ref, atol=0.0):
    """None when out equals ref (to atol), else the largest difference, in words."""
    if isinstance(out, Raised) or isinstance(ref, Raised):
        same = isinstance(out, Raised) and isinstance(ref, Raised) and type(out.error) is type(ref.error)
        return None if same else f"your code {out!r}" if isinstance(out, Raised) else \
            f"the reference raises ({ref.error}) here, yours returned {short(out)}"
    if isinstance(ref, torch.Tensor):
        return tensor_difference(out, ref, atol)
    if isinstance(ref, dict):
        if not isinstance(out, dict) or set(out) != set(ref):
            return f"yours has the keys {sorted(out) if isinstance(out, dict) else short(out)}, " \
                   f"the reference {sorted(ref)}"
        for key in ref:
            problem = difference(out[key], ref[key], atol)
            if problem:
                return f"at [{key!r}]: {problem}"
        return None
    if isinstance(ref, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(ref):
            return f"yours is {short(out)}, the reference {short(ref)}"
        for k, (o, r) in enumerate(zip(out, ref)):
            problem = difference(o, r, atol)
            if problem:
                return f"at item {k}: {problem}"
        return None
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(ref, float) or isinstance(out, float):
        if not isinstance(out, (int, float)) or isinstance(out, bool) or not math.isclose(out, ref, rel_tol=0, abs_tol=atol):
            return f"yours {short(out)}, the reference {short(ref)}"
        return None
    if type(out) is not type(ref) or out != ref:
        return f"yours {short(out)}, the reference {short(ref)}"
    return None


def tensor_difference(out, ref, atol):
    if not isinstance(out, torch.Tensor):
        return f"yours is {short(out)}, the reference a tensor of shape {tuple(ref.shape)}"
    if out.shape != ref.shape:
        return f"your shape is {tuple(out.shape)}, the reference's {tuple(ref.shape)}"
    if (out.dtype == torch.bool) != (ref.dtype == torch.bool):
        return f"your dtype is {out.dtype}, the reference's {ref.dtype}"
    if ref.dtype == torch.bool or not ref.is_floating_point():
        wrong = (out != ref).nonzero()
        if len(wrong) == 0:
            return None
        first = tuple(wrong[0].tolist())
        return (f"{len(wrong)} of {ref.numel()} entries differ; the first at index {first}: "
                f"yours {out[first].item()}, the reference {ref[first].item()}")
    if not torch.isfinite(out).all():
        return f"yours has {(~torch.isfinite(out)).sum().item()} NaN or inf entries"
    err = (out.double() - ref.double()).abs()
    worst = err.max().item() if err.numel() else 0.0
    if worst <= atol:
        return None
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    note = f" (your dtype is {out.dtype}, the reference's {ref.dtype})" if out.dtype != ref.dtype else ""
    return (f"largest difference {worst:.3g} at index {where}: yours {out[where].item():.6g}, "
            f"the reference {ref[where].item():.6g}; allowed {atol:g}{note}")


def short(x, limit=160):
    text = f"tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) and x.numel() > 8 else \
        repr(x.tolist() if isinstance(x, torch.Tensor) else x)
    return text if len(text) <= limit else text[:limit] + " ..."


def grid(mask):
    """A small boolean matrix as rows of '#' (True) and '.' (False)."""
    return ["".join("#" if v else "." for v in row) for row in mask.tolist()]


# -----------------------------------------------------------------------------
# Reports

def not_started(error):
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return (f"not started: `{frame.name}` in {relpath(frame.filename)} still raises NotImplementedError. "
            "Open the file, read its docstring, and write it.")


def relpath(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def failure(case, out, ref, problem, named):
    lines = ["FAIL. The smallest failing case:", f"  {case.what}", f"  what is wrong: {problem}"]
    if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) and ref.dtype == torch.bool \
            and out.shape == ref.shape and ref.dim() == 2 and max(ref.shape) <= 24:
        lines += ["  yours" + " " * (ref.size(1) + 2) + "the reference   (rows: queries, columns: keys; # = attends)"]
        lines += [f"  {a}  {' ' * 5}{b}" for a, b in zip(grid(out), grid(ref))]
    lines.append(f"  the invariant it breaks: {case.invariant}")
    for bug in named:
        lines.append(f"  This behaves like a known mistake: {bug.name}. {bug.why}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Helpers the checks share: tiny float64 models, patching, forbidden calls

REPO = Path(__file__).resolve().parents[1]


def tiny_model(attn="orthros", seed=0, randomize=True, **overrides):
    """A tiny float64 model in eval mode. randomize=True moves the scale-offsets (and the optional
    convolution) off their identity start, so that the two streams' queries differ."""
    kw = dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4, attn=attn, max_seq_len=512)
    torch.manual_seed(seed)
    model = orthros.Orthros(orthros.OrthrosConfig(**{**kw, **overrides})).double().eval()
    if randomize:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.split(".")[-1] in ("alpha", "beta", "alpha_out", "beta_out", "conv"):
                    p.add_(0.5 * torch.randn_like(p))
    return model


def tokens(B, T, vocab=37, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def patched(owner, **attrs):
    """Set owner.name = value for each, and restore the originals afterwards, whatever happens."""
    old = {name: getattr(owner, name) for name in attrs}
    try:
        for name, value in attrs.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(owner, name, value)


def forbidden(owner, *names, why="this exercise asks you to write it"):
    """Make owner's methods raise when called: the student must not hand the work back to them."""
    def refusing(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"your code called {owner.__name__}.{name}, which {why}")
        return refuse
    return patched(owner, **{name: refusing(name) for name in names})
