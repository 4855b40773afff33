"""The checker every exercise shares (an exercise's files, and the parts of a checker: exercises/README.md).

A check runs the checker's cases, smallest first (those that take a model: on each ZOO member), on an answer (a student's
file; a bug or mutant: the stored solution with edits; the reference), each on its own deep copy of the inputs. What the
answer returns is compared with the reference's output (or expected(**inputs)): its form first (type; shape, dtype,
device; length or keys), then its values (to TOLERANCE); or compare(output, right) or holds(output) says what is wrong.
The inputs must come back unchanged. A known bug is named when it does what a failing answer does, to its next failure.
While the answer runs, the reference and FORBIDDEN raise however reached, and a file importing from exercises/ is refused.
What the checker's code raises is its error, not the student's, but in `with using()` (code using the answer's output).
"""

import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import re
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

import orthros


def numbered(folder):
    """{number: name} of the checkers in folder; two of one number (two teachers' branches merged) are an error."""
    paths = sorted(folder.glob("ex[0-9][0-9]_*.py"))
    for a, b in zip(paths, paths[1:]):
        if a.name[:4] == b.name[:4]:
            raise ImportError(f"{folder} holds two checkers numbered {int(a.name[2:4])}, {a.name} and {b.name}: renumber one")
    return {int(path.name[2:4]): path.stem for path in paths}


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STUBS, SOLUTIONS, MINE, CHECKS = HERE / "stubs", HERE / "solutions", HERE / "mine", HERE / "checks"
EXERCISES = numbered(CHECKS)   # number -> name
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}   # atol by dtype (bfloat16: rtol too)


@dataclass
class Case:
    what: str                    # the inputs and the call, in words: the case a student re-runs by hand
    inputs: object               # {name: value}, or () -> {name: value}; every run gets its own deep copy
    call: object                 # the name of the answer's function called with the inputs, or (answer, **inputs) -> output
    invariant: str               # what the right output satisfies, in words
    expected: Callable = None    # (**inputs) -> the right output, instead of the reference's call
    compare: Callable = None     # (output, right output) -> None or what is wrong, instead of forms and values
    holds: Callable = None       # output -> None or what is wrong: a property, no reference run
    device: str = None           # inputs() runs under `with torch.device(device)` (meta: shapes, no values)
    dtype: torch.dtype = None    # the floating tensors and modules of the inputs are converted to it (and it is named)
    output: str = "your output"  # the output in words, for the report

    def __post_init__(self):
        self.what += f", in {str(self.dtype)[6:]}" if self.dtype else ""


# A wrong answer: the stored solution with edits {old: new} (each old found once), or a whole source; expect: words its
# report must contain. A Bug, a known mistake, is named (with its expect: why it is wrong) when an answer fails like it.
Mutant = collections.namedtuple("Mutant", "name expect edits source", defaults=(None, None))
Bug = collections.namedtuple("Bug", Mutant._fields, defaults=(None, None))


# status: "PASS", "FAIL", "not started", "waiting" (training runs), "ERROR" (the checker's); named: the bugs it fails like
Result = collections.namedtuple("Result", "status message seconds named", defaults=("", 0.0, ()))
# An answer's functions; problem: why it cannot run; trusted: the reference (unguarded, its errors are the checker's)
Answer = collections.namedtuple("Answer", "functions path problem started trusted", defaults=(None, None, True, False))
# An answer's outcome on a case; kind: "value", "raised", "wrong" (a case's words), "changed" (an input), "not started"
Outcome = collections.namedtuple("Outcome", "output problem kind", defaults=(None, None, "value"))


class Wrong(Exception):
    """Raised by a case's code: the case fails with this message."""


class NotReady(Exception):
    """Something the check needs is not there yet (the recall lab's trained runs)."""


class Refused(Exception):
    """The answer's code called something its exercise refuses."""


class CheckerError(Exception):
    """The checker's own code failed inside the answer's call: args[0] is what it raised."""


def load_spec(n):
    return importlib.import_module(f"exercises.checks.{EXERCISES[n]}")


def stub_source(spec):
    return (STUBS / f"{spec.__name__.rsplit('.', 1)[-1]}.py").read_text()


def solved_source(spec):
    """The stored solution's file (a "replace" exercise's: the repository's function, copied; checked against it live)."""
    return (SOLUTIONS / f"{spec.__name__.rsplit('.', 1)[-1]}.py").read_text()


# Answers, and the guard: while the answer's code runs, each refused function's code raises

_loaded, ANSWER_FILES = itertools.count(), set()   # ANSWER_FILES: their frames are the student's
STATE = SimpleNamespace(active=False, why={}, refusals=[])   # refusals: all raised (an answer may catch one)


def load_answer(spec, source, filename):
    """A student's file run as a module, guarded; refused if it imports from exercises/ or holds a refused function."""
    filename, where = str(filename), relpath(filename)
    ANSWER_FILES.add(filename)
    module = types.ModuleType(f"_exercise_answer_{next(_loaded)}")
    module.__file__, sys.modules[module.__name__] = filename, module   # for what needs its module (dataclasses)
    try:
        tree = ast.parse(source, filename)
        for node in (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            name = next((name for name in names if name.split(".")[0] == "exercises"), None)
            if name:
                return Answer({}, filename, f"{where} does not import: ImportError: line {node.lineno} imports `{name}`, "
                              "which is not available to your code: exercises/ holds the stored solutions and the "
                              "checker. Write the function yourself.")
        with guarding(spec):
            exec(compile(tree, filename, "exec"), module.__dict__)
    except Exception as e:
        started = not isinstance(e, NotImplementedError) or bool(str(e))
        return Answer({}, filename, f"{where} does not import: {one_line(e)}" if started else None, started=started)
    missing = [f for f in spec.FUNCTIONS if not callable(getattr(module, f, None))]
    if missing:
        return Answer({}, filename, f"{where} has no function `{missing[0]}`: keep the stub's name and signature")
    refused = refused_functions(spec)
    for name, value in vars(module).items():
        fn = inspect.unwrap(getattr(value, "__func__", value)) if callable(value) else None
        if isinstance(fn, types.FunctionType) and fn in refused:
            return Answer({}, filename, f"the name `{name}` in {where} holds {fn.__module__}.{fn.__qualname__}, which this "
                          f"exercise refuses ({refused[fn]}). Remove that import or reference: the checker compares your "
                          "own code with it.")
    return Answer({f: getattr(module, f) for f in spec.FUNCTIONS}, filename)


def as_answer(spec, impl):
    """An Answer from an Answer, a Bug or Mutant (loaded as a student's file), or a namespace (REFERENCE: trusted)."""
    if isinstance(impl, Answer):
        return impl
    if not isinstance(impl, (Mutant, Bug)):
        return Answer({f: getattr(impl, f) for f in spec.FUNCTIONS}, trusted=impl is spec.REFERENCE)
    source = solved_source(spec) if impl.source is None else impl.source
    for old, new in (impl.edits or {}).items():
        if source.count(old) != 1:
            raise ValueError(f"{impl.name}: an edit's text is in the solution {source.count(old)} times, not once: {old!r}")
        source = source.replace(old, new)
    return load_answer(spec, source, f"<{'known bug' if isinstance(impl, Bug) else 'mutant'}: {impl.name}>")


def refused_functions(spec):
    """{function: why}: the reference's functions and FORBIDDEN's, unwrapped (a decorated method's own code)."""
    found = {inspect.unwrap(getattr(spec.REFERENCE, f)): "the reference answer of this exercise" for f in spec.FUNCTIONS}
    return {**found, **{inspect.unwrap(fn): why for fn, why in getattr(spec, "FORBIDDEN", {}).items()}}


def refusing(*args, **kwargs):
    """The code of each refused function while the answer runs: among that function's globals, it reaches this module
    by __import__; its co_filename names the function."""
    here = __import__("exercises.framework", fromlist=["STATE"])
    name = here.sys._getframe().f_code.co_filename
    here.STATE.refusals.append(here.Refused(f"your code called {name} ({here.STATE.why[name]}), which the checker refuses "
                                            "while your code runs"))
    raise here.STATE.refusals[-1]


@contextlib.contextmanager
def guarding(spec):
    """Each refused function's __code__ swapped for refusing's, then restored: captured ones (f = Orthros.forward) too."""
    if STATE.active:   # the answer calling its own functions
        yield
        return
    saved, STATE.active = {}, True
    try:
        for fn, why in refused_functions(spec).items():
            name = f"{fn.__module__}.{fn.__qualname__}"
            STATE.why[name], saved[fn] = why, fn.__code__
            fn.__code__ = refusing.__code__.replace(co_name=fn.__name__, co_qualname=fn.__qualname__, co_filename=name)
        yield
    finally:
        for fn, code in saved.items():
            fn.__code__ = code
        STATE.active = False


def guarded(spec, answer):
    """The answer's functions, run under the guard: what they raise is the answer's; a refusal they caught fails too."""
    def wrap(fn):
        @functools.wraps(fn)
        def answer_function(*args, **kwargs):
            refusals = len(STATE.refusals)
            with guarding(spec):
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    e.by_answer = not isinstance(e, (Wrong, Refused, NotReady, CheckerError))
                    raise
            if len(STATE.refusals) > refusals:
                raise STATE.refusals[-1]
            return value
        return answer_function
    return SimpleNamespace(**{name: fn if answer.trusted else wrap(fn) for name, fn in answer.functions.items()})


def checker_hook(fn):
    """Checker code run inside the answer's call (a hook): what it raises is the checker's error (or a Wrong)."""
    @functools.wraps(fn)
    def hook(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (Wrong, NotReady):
            raise
        except Exception as e:
            raise CheckerError(e) from e
    return hook


@contextlib.contextmanager
def using(what):
    """Around checker code that uses what the answer returned: what it raises is the answer's failure, in words."""
    try:
        yield
    except Exception as e:
        if isinstance(e, (Wrong, NotReady, Refused)) or getattr(e, "by_answer", False):
            raise
        raise Wrong(f"{what} raised {one_line(e)}") from e


# Running the cases

CACHE = {}   # what the checks of one process share: each spec's cases and their right outputs
POOL = {}    # id(case) -> inputs an answer's run left as they were made (a deep copy of a model costs many forwards)


def check(spec, impl, summary=True, **options):
    """Run spec's cases on impl (an Answer, the reference, a Bug or Mutant) in one CPU thread; then spec.after_pass."""
    threads, start = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)
    try:
        return run_cases(spec, impl, summary, options)._replace(seconds=time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def run_cases(spec, impl, summary, options):
    case = None
    try:
        answer = as_answer(spec, impl)
        if answer.problem or not answer.started:
            return Result("FAIL", f"FAIL. {answer.problem}") if answer.problem else Result("not started", not_started(answer.path))
        functions, cases = guarded(spec, answer), cases_of(spec, options)
        for i, (case, truth) in enumerate(cases):
            outcome = run_case(spec, case, functions, truth())
            if outcome.kind == "not started":
                return Result("not started", not_started(answer.path, outcome.output))
            if outcome.problem:
                named = [] if answer.trusted else known_bugs(spec, functions, cases, i, outcome)
                outcome = outcome._replace(problem=outcome.problem + off_by_one(spec, functions, cases, i, outcome))
                return Result("FAIL", failure(case, outcome, named), named=[bug.name for bug in named])
        case = None
        try:
            return Result("PASS", spec.after_pass(functions, **options) if summary and hasattr(spec, "after_pass") else "")
        except Exception as e:
            if not getattr(e, "by_answer", False):
                raise
            return Result("PASS", f"(The summary could not run: your code raised {one_line(e)}{answer_line(e)})")
    except NotReady as e:
        return Result("waiting", str(e))
    except Exception as e:   # the checker's own code (a KeyboardInterrupt is no Exception: it stops the check)
        return Result("ERROR", checker_failure(case, e.args[0] if isinstance(e, CheckerError) else e))


def cases_of(spec, options):
    """(case, its right output on demand) for each of spec.cases(**options): built once a process, and kept."""
    key = (id(spec), repr(sorted(options.items())))
    if key not in CACHE:
        CACHE[key] = (spec, list(spec.cases(**options)), {})   # (the spec: its id stays its own)
    _, cases, truths = CACHE[key]
    def truth(i, case):   # the right output, once: expected(**inputs), or the reference's call, on its own inputs
        if i not in truths and not (case.holds and not case.expected):
            inputs = fresh(case)
            truths[i] = case.expected(**inputs) if case.expected else called(case, spec.REFERENCE, inputs)
        return truths.get(i)
    return [(case, functools.partial(truth, i, case)) for i, case in enumerate(cases)]


def called(case, answer, inputs):
    return getattr(answer, case.call)(**inputs) if isinstance(case.call, str) else case.call(answer, **inputs)


def run_case(spec, case, functions, truth):
    """The answer's outcome on the case: what its call gave, judged, and whether it changed its inputs."""
    inputs = POOL.pop(id(case), None) or fresh(case)
    before = {name: flat(value) for name, value in inputs.items()}
    try:
        out = called(case, functions, inputs)
        outcome = Outcome(out, case.holds(out) if case.holds else case.compare(out, truth) if case.compare else
                          difference(out, truth, case.output))
    except Wrong as e:
        outcome = Outcome(problem=str(e), kind="wrong")
    except Refused as e:
        outcome = Outcome(problem=f"refused: {e}{answer_line(e)}", kind="raised")
    except Exception as e:
        if not getattr(e, "by_answer", False):
            raise   # the checker's own error
        if isinstance(e, NotImplementedError) and not str(e):
            return Outcome(e, kind="not started")
        outcome = Outcome(problem=f"your code raised {one_line(e)}{answer_line(e)}", kind="raised")
    changed = changes(spec, before, inputs)
    if not changed:
        POOL[id(case)] = inputs   # still as fresh() made them: the next run of the case takes them
    if changed and outcome.problem:
        return outcome._replace(problem=f"{outcome.problem}\n  and: {changed}")
    return outcome._replace(problem=changed, kind="changed") if changed else outcome


def known_bugs(spec, functions, cases, i, outcome):
    """The known bugs that do what the answer does on every case to its first failure, the i-th, and on to its next."""
    runs = [(*cases[i], outcome)] + [(case, truth, Outcome()) for case, truth in cases[:i]]
    named = [bug for bug in spec.BUGS if all(same_report(spec, bug, *run) for run in runs)]
    with contextlib.suppress(NotReady):   # (the recall lab's trained runs: not there yet)
        for case, truth in cases[i + 1:] if named else ():
            theirs = run_case(spec, case, functions, truth())
            named = [bug for bug in named if same_report(spec, bug, case, truth, theirs)]
            if theirs.problem or not named:
                break
    return named


def same_report(spec, bug, case, truth, outcome):
    """Does the known bug pass the case the answer passed, or fail it with the answer's report (line numbers aside)?"""
    try:
        theirs = run_case(spec, case, guarded(spec, as_answer(spec, bug)), truth())
    except Exception:
        return False
    unplaced = lambda text: re.sub(r" \(at [^()]*, line \d+\)", "", text or "")
    return theirs.kind == outcome.kind and unplaced(theirs.problem) == unplaced(outcome.problem)


def off_by_one(spec, functions, cases, i, outcome):
    """" (off by one)" when the answer's int is one off on the i-th case and the same way on every later case of its call
    (one at least), else "": a gap of 1 on one case can be a coincidence."""
    gap = lambda truth, outcome: outcome.output - truth if type(outcome.output) is type(truth) is int else None
    first, (case, _) = gap(cases[i][1](), outcome), cases[i]
    if first not in (1, -1):
        return ""
    gaps = [gap(truth(), run_case(spec, other, functions, truth())) for other, truth in cases[i + 1:] if other.call == case.call]
    return " (off by one)" if gaps and set(gaps) == {first} else ""


def fresh(case):
    """A deep copy of case.inputs(), built on the case's device and converted to its dtype."""
    def place(x):   # a tensor or a module, on the case's device, its floating point numbers in its dtype
        if isinstance(x, (torch.Tensor, nn.Module)):
            x = x.to(case.device) if case.device else x
            return x.to(case.dtype) if case.dtype and (isinstance(x, nn.Module) or x.is_floating_point()) else x
        return x
    with torch.device(case.device) if case.device else contextlib.nullcontext():
        inputs = case.inputs() if callable(case.inputs) else case.inputs   # made here: on the case's device
    return {name: place(value) for name, value in copy.deepcopy(inputs).items()}


# Untouched inputs: each input flattened to {path: what is there} before the call, compared with it after

GONE = object()   # what is at a path that is not there


def flat(x, path="", clone=True):
    """x as {path: value}: a tensor's copy (and requires_grad), another value, a container's type and its parts (a
    module's: its weights, its submodules' public attributes such as mode and config, and their number of hooks)."""
    if isinstance(x, torch.Tensor):
        return {path: x.detach().clone() if clone and x.device.type != "meta" else x.detach(),
                f"{path}.requires_grad": x.requires_grad}
    if isinstance(x, nn.Module):
        found = {f".{k}": v for k, v in x.state_dict(keep_vars=True).items()}
        for name, module in x.named_modules():
            prefix = f".{name}" if name else ""
            found.update({f"{prefix}.{k}": v for k, v in vars(module).items() if not k.startswith("_")})
            found[f"{prefix}.hooks"] = sum(len(v) for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict))
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        found = {f".{f.name}": getattr(x, f.name) for f in dataclasses.fields(x)}
    elif isinstance(x, (dict, list, tuple)):
        found = {f"[{k!r}]": v for k, v in (x.items() if isinstance(x, dict) else enumerate(x))}
    else:
        return {path: x}
    kept = {path: type(x)}
    for key, part in found.items():
        kept.update(flat(part, path + key, clone))
    return kept


def changes(spec, before, inputs):
    """What the answer changed among its inputs, in words, or None."""
    who = f"your {spec.FUNCTIONS[0]}" if len(spec.FUNCTIONS) == 1 else "your code"
    for name, old in before.items():
        new = flat(inputs[name], clone=False)
        for path in [*old, *(path for path in new if path not in old)]:
            was, now = old.get(path, GONE), new.get(path, GONE)
            if was is GONE or now is GONE:
                what = "is new: it was not there before" if was is GONE else "is gone"
            elif isinstance(was, torch.Tensor) and not difference(now, was, values=False):
                differ = (was != now) & ~(was.isnan() & now.isnan()) if was.device.type != "meta" else torch.zeros(())
                what = f"changed in place ({int(differ.sum())} of {was.numel()} entries differ)" if differ.any() else None
            elif isinstance(was, torch.Tensor) or isinstance(now, torch.Tensor):
                what = f"was {describe(was)}, now {describe(now)}"
            else:
                with contextlib.suppress(Exception):
                    if was is now or bool(was == now) or (was != was and now != now):
                        continue
                what = f"was {short(was, 60)}, now {short(now, 60)}"
            if what:
                where = f": `{name}{path}` {what}" if path else what[7:] if what.startswith("changed ") else f": {what}"
                return f"{who} changed its input `{name}`{where}"
    return None


# Forms and values, in words

def difference(out, ref, label="your output", values=True):
    """What differs between out and ref, in words, or None: their forms first (the type; a tensor's shape, dtype and
    device; a container's length or keys, and its items' forms), then their values (to TOLERANCE) unless values=False."""
    be, have = ("are", "have") if re.search(r"[^s]s$", label.split()[-1]) else ("is", "has")
    if isinstance(ref, (tuple, list, dict)):
        if not isinstance(out, dict if isinstance(ref, dict) else (tuple, list)) or len(out) != len(ref):
            return f"{label} {be} {describe(out)}, expected {describe(ref)}"
        if isinstance(ref, dict) and set(out) != set(ref):
            return (f"{label} {have} the keys {short(sorted(map(str, set(out) - set(ref))), 100)} too many, "
                    f"{short(sorted(map(str, set(ref) - set(out))), 100)} missing")
        keys = list(ref) if isinstance(ref, dict) else range(len(ref))
        names = {k: f"{label}[{k!r}]" if isinstance(ref, dict) else f"item {k} of {label}" for k in keys}
        form = next(filter(None, (difference(out[k], ref[k], names[k], False) for k in keys)), None)
        if form or not values:
            return form
        for k in keys:
            problem = difference(out[k], ref[k], names[k])
            if problem:
                return f"at [{k!r}]: {problem}" if isinstance(ref, dict) else f"at item {k}: {problem}"
        return None
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return f"{label} {be} {describe(out)}, expected {describe(ref)}"
        for what, mine, theirs in (("shape", tuple(out.shape), tuple(ref.shape)), ("dtype", out.dtype, ref.dtype)):
            if mine != theirs:
                return f"{label} {have} {what} {mine}, expected {theirs}"
        if out.device.type != ref.device.type:
            return f"{label} {be} on {out.device.type}, expected {ref.device.type}"
        return tensor_difference(out, ref) if values else None
    if type(out) is not type(ref) and not (isinstance(ref, float) and type(out) is int):
        if isinstance(ref, (bool, int, float, str, type(None))) or not isinstance(out, type(ref)):
            return f"{label} {be} {describe(out)}, expected {describe(type(ref))}"
    if not values:
        return None
    close = math.isclose(out, ref, abs_tol=TOLERANCE[torch.float64]) if isinstance(ref, float) else out == ref
    return None if close else f"yours {short(out)}, the reference {short(ref)}"


def tensor_difference(out, ref, atol=None, rtol=None):
    if "meta" in (out.device.type, ref.device.type):
        return None   # no values on meta: the form is all there is
    if atol is None:
        atol = TOLERANCE.get(ref.dtype, 0.0)
        rtol = atol if ref.dtype == torch.bfloat16 else rtol
    out, ref, rtol = out.detach().cpu(), ref.detach().cpu(), rtol or 0.0
    bad = ~torch.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    gap = torch.where(bad, (out.double() - ref.double()).abs().nan_to_num(nan=math.inf), -1.0)
    at = tuple(int(i) for i in torch.nonzero(gap == gap.max())[0])   # the index of the largest difference
    text = f"{int(bad.sum())} of {bad.numel()} entries differ"
    if not ref.is_floating_point():
        return f"{text}; the first at index {at}: yours {out[at].item()}, the reference {ref[at].item()}"
    rounding = " (about float32's rounding: does a step go through float32?)" \
        if ref.dtype == torch.float64 and 1e-12 < gap[at] <= 1e-6 * max(1.0, abs(ref[at].item())) else ""
    return (f"{text}; the largest difference, {gap[at]:.3g}{rounding}, at index {at}: yours {out[at].item():.6g}, "
            f"the reference {ref[at].item():.6g}; allowed {atol:g}" + (f" + {rtol:g} x |reference|" if rtol else ""))


def describe(value):
    """The value's kind in words: "a tensor of shape (2, 3) (torch.float32)", "a list of 2 items", "an int (3)"."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    name = (value if isinstance(value, type) else type(value)).__name__
    scalar = isinstance(value, (bool, int, float, str, type(None)))
    return ("an " if name[0] in "aeiouAEIOU" else "a ") + name + (f" ({short(value, 60)})" if scalar else "")


def short(x, limit=160):
    text = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) and x.numel() > 8 else \
        repr(x.tolist() if isinstance(x, torch.Tensor) else x)
    return text if len(text) <= limit else text[:limit] + " ..."


def one_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# Reports

def relpath(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except (ValueError, OSError):
        return str(path)


def answer_line(error, mine=lambda filename: filename in ANSWER_FILES):
    frames = [f for f in traceback.extract_tb(error.__traceback__) if mine(f.filename)]
    return f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""


def not_started(path, error=None):
    frame = traceback.extract_tb(error.__traceback__)[-1] if error is not None else None
    how = f"Start it with `python -m exercises start {int(Path(path).name[2:4])}` (it copies the stub to exercises/mine/), " \
        "then open that file, read its docstring, and write it." if Path(path).resolve().parent == STUBS else \
        "Open the file, read its docstring, and write it."
    return (f"not started: {f'`{frame.name}` in {relpath(frame.filename)}' if frame else relpath(path)} still raises "
            f"NotImplementedError. {how}")


def failure(case, outcome, named):
    lines = ["FAIL. The smallest failing case:", f"  {case.what}", f"  what is wrong: {outcome.problem}",
             f"  the invariant it breaks: {case.invariant}"]
    return "\n".join(lines + [f"  This behaves like a known mistake: {bug.name}. {bug.expect}" for bug in named])


def checker_failure(case, error):
    where = answer_line(error, lambda filename: filename.startswith(str(HERE)))   # the checker's own line
    return (f"ERROR. The checker's own code failed on this case, not your code:\n  {case.what if case else 'outside the cases'}"
            f"\n  {one_line(error)}{where}\n  This is a bug in the checker: please show this message to your teacher.")


# What the checks share: tiny models drawn in float64, inputs, a look at what the blocks are handed

def change(old, new):
    """new - old, for a probe case: how the answer's number moves (what the subtraction raises is the answer's failure)."""
    with using("subtracting your two numbers"):
        return new - old


def tiny_model(attn="orthros", seed=0, dtype=torch.float64, **overrides):
    """A tiny model in eval mode, its weights drawn in dtype (float64: what float32 cannot hold), vectors and conv moved."""
    config = orthros.OrthrosConfig(**{**dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4, attn=attn,
                                             max_seq_len=512), **overrides})
    default = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        model = orthros.Orthros(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("conv.weight"):
                    p.add_(0.5 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(default)
    return model


# The zoo: a tiny model for each option of orthros.py, (name, tiny_model's overrides, dtype). Every checker that takes a
# model runs cases on each member, so a new option reaches every exercise as one more member here.
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
ZOO = [("the original", {}, None),
       ("Llama-like: untied head, n_head=4 with n_kv_head=2 (GQA), SwiGLU, Q/K/V biases, norm_eps=1e-5, rope_base=500000.0, "
        "llama3 RoPE scaling", dict(tie_embeddings=False, n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=40, qkv_bias=True,
                                    norm_eps=1e-5, rope_base=500000.0, rope_scaling=LLAMA3), None),
       ("scale_offset=False (the paper's w/o SO)", dict(scale_offset=False), None), ("the original", {}, torch.bfloat16)]


def tokens(B, T, vocab=37, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def handed_to_blocks(model, B, rows, T, why, positions):
    """Check what the answer hands each block before the block runs: z of shape (B, rows, C) (rows None: any), T, and
    the RoPE tables (cos, sin) of positions(rows of z), as the model's forward makes them (its dtype, base, scaling)."""
    def check(block, args, kwargs):
        given = inspect.signature(block.forward).bind(*args, **kwargs).arguments
        z, i = given.get("z"), list(model.blocks).index(block)
        shape = (B, rows or getattr(z, "shape", (0, "rows"))[1], model.config.n_embd)
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != shape:
            raise Wrong(f"your code hands block {i} z of {describe(z)[2:]}, expected shape {shape}: {why}")
        if given.get("T") != T:
            raise Wrong(f"your code hands block {i} T={given.get('T')!r}, expected {T}: T counts the base tokens, the "
                        f"first T rows of z ({why})")
        at, c = positions(z.size(1)), model.config
        right = orthros.rope_cos_sin(at.to(z.device), c.n_embd // c.n_head, c.rope_base, model.wte.weight.dtype, c.rope_scaling)
        wrong = difference(given.get("rope"), right, "the RoPE tables (cos, sin)")
        if wrong:
            raise Wrong(f"your code hands block {i} RoPE tables that are not those of the positions {short(at.tolist(), 60)} "
                        f"(in the model's dtype, by its config's rope_base and rope_scaling): {wrong}")
    hooks = [block.register_forward_pre_hook(checker_hook(check), with_kwargs=True) for block in model.blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
