"""The checker every exercise shares: the cases run live against the real code, the reference first; the smallest
failing case is reported with what is wrong and the invariant it breaks; known mistakes are named; the inputs must
come back unchanged; the reference and the work the exercise asks for are refused while the answer's code runs.
An exercise is three files exNN_<name>.py: its stub (exercises/stubs/), stored solution (exercises/solutions/) and
checker (exercises/checks/, the parts it declares: exercises/README.md, "For teachers").

A case's output is compared with the reference's (the same call on its own copy of the inputs), or expected(**inputs),
or judged by holds(output) -> None or what is wrong (a property: no reference run): the form first (the type; a
tensor's shape, dtype and device; a container's length or keys), then the values, exactly or to atol/rtol
(torch.isclose); on the device "meta" the form only. The reference and FORBIDDEN raise while the answer's code runs,
however reached (called, captured at import, through another function); a file that imports from exercises/ is
refused before it runs. Checker code that uses what the answer returned goes in `with using("your model(idx)")`, so
that what it raises is the answer's failure; checker code run inside the answer's call (a hook) in checker_hook;
`raise Wrong("...")` fails the case in words; anything else the checker raises is its own error, never the student's.
A Bug or Mutant is the solved file's text with edits {old: new} (each old found once), or a whole source=, loaded as a
student's file is; each must fail, a mutant's report containing `expect`. An answer that fails a case with the same
report as a bug there is told the bug's name and why (its `expect`).
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
import linecache
import math
import re
import sys
import textwrap
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Callable

import numpy
import torch
import torch.nn as nn

import orthros

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STUBS, MINE, CHECKS = HERE / "stubs", HERE / "mine", HERE / "checks"
EXERCISES = {int(p.name[2:4]): p.stem for p in sorted(CHECKS.glob("ex[0-9][0-9]_*.py"))}   # number -> name


@dataclass
class Case:
    what: str                    # the inputs and the call, in words: the case a student re-runs by hand
    inputs: Callable             # () -> {name: value}; every run gets its own deep copy
    call: Callable               # (answer, **inputs) -> the output
    invariant: str               # what the right output satisfies, in words
    expected: Callable = None    # (**inputs) -> the right output, instead of the reference's call
    holds: Callable = None       # output -> None or what is wrong
    atol: float = 0.0
    rtol: float = 0.0
    device: str = None           # inputs() runs under `with torch.device(device)`; "cuda" is skipped without one
    dtype: torch.dtype = None    # the floating tensors and modules of the inputs are converted to it
    output: str = "your output"  # the output in words, for the report
    mutable: tuple = ()          # the inputs the answer may change (a cache it appends to)


@dataclass
class Mutant:
    name: str
    expect: str                  # words its report must contain (a Bug: why it is wrong, printed when it is named)
    edits: dict = None
    source: str = None


class Bug(Mutant):
    """A known mistake, named in the report of an answer that fails as it does."""


@dataclass
class Result:
    status: str                  # "PASS", "FAIL", "not started", "waiting" (training runs), "ERROR" (the checker's)
    message: str = ""
    seconds: float = 0.0
    named: list = field(default_factory=list)   # the known bugs the answer fails like


@dataclass
class Answer:
    functions: dict
    path: str = None
    problem: str = None          # why it cannot run: it does not import, or holds a refused function
    started: bool = True
    trusted: bool = False        # the reference: unguarded, and what it raises is the checker's error


@dataclass
class Outcome:
    output: object = None
    problem: str = None          # None: right
    kind: str = "value"          # "value", "raised", "wrong" (a case's own words), "changed", "not started"


class Wrong(Exception):
    """Raised by a case's code: the case fails with this message."""


class NotReady(Exception):
    """Something the check needs is not there yet (the recall lab's trained runs)."""


class Refused(Exception):
    """The answer's code called something its exercise refuses."""


class CheckerError(Exception):
    """The checker's own code failed: args[0] is what it raised."""


def load_spec(n):
    return importlib.import_module(f"exercises.checks.{EXERCISES[n]}")


def stub_source(spec):
    """The stub's text, from its one home, exercises/stubs/, which a student's work never changes."""
    return (STUBS / f"{spec.__name__.rsplit('.', 1)[-1]}.py").read_text()


# -----------------------------------------------------------------------------
# Answers: a student's file, a bug's or mutant's text, or the reference

_loaded, ANSWER_FILES = itertools.count(), set()   # ANSWER_FILES: their frames are the student's


def load_answer(spec, source, filename):
    """A student's file run as a module, its top level guarded as the answer's calls are; refused before it runs if it
    imports from exercises/, and after if a name in it holds a refused function."""
    filename = str(filename)
    where = relpath(filename)
    ANSWER_FILES.add(filename)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)   # tracebacks show it
    module = ModuleType(f"_exercise_answer_{next(_loaded)}")
    module.__file__, sys.modules[module.__name__] = filename, module   # for what needs its module (dataclasses)
    try:
        tree = ast.parse(source, filename)
        for node in ast.walk(tree):
            for name in [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []:
                if name.split(".")[0] == "exercises":
                    return Answer({}, filename, f"{where} does not import: ImportError: line {node.lineno} imports "
                                  f"`{name}`, which is not available to your code: exercises/ holds the stored "
                                  "solutions and the checker. Write the function yourself.")
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
            return Answer({}, filename, f"the name `{name}` in {where} holds {label(fn)}, which this exercise refuses "
                          f"({refused[fn]}). Remove that import or reference: the checker compares your own code with it.")
    return Answer({f: getattr(module, f) for f in spec.FUNCTIONS}, filename)


def as_answer(spec, impl):
    """An Answer from a student's Answer, a Bug or Mutant, or a namespace of functions (the reference is trusted)."""
    if isinstance(impl, Answer):
        return impl
    if not isinstance(impl, Mutant):
        return Answer({f: getattr(impl, f) for f in spec.FUNCTIONS}, trusted=impl is spec.REFERENCE)
    source = impl.source
    if source is None:
        source = solved_source(spec)
        for old, new in (impl.edits or {}).items():
            if source.count(old) != 1:
                raise CheckerError(ValueError(f"{impl.name}: an edit's text is in the solution {source.count(old)} times, not once: {old!r}"))
            source = source.replace(old, new)
    return load_answer(spec, source, f"<{'known bug' if isinstance(impl, Bug) else 'mutant'}: {impl.name}>")


def solved_source(spec):
    """A whole file that solves the exercise, as exercises/mine/ could hold it (`solution N --show`, and what bugs and
    mutants edit): the stored solution's file; or the stub's docstring and imports, the reference's functions, and
    what they need (imported, or a stored solution's helper by its source)."""
    if spec.__name__ not in SOLVED:
        SOLVED[spec.__name__] = solved_text(spec)
    return SOLVED[spec.__name__]


SOLVED = {}


def solved_text(spec):
    functions = [inspect.unwrap(getattr(spec.REFERENCE, f)) for f in spec.FUNCTIONS]
    if len({fn.__module__ for fn in functions}) == 1 and functions[0].__module__.startswith("exercises.solutions."):
        return inspect.getsource(sys.modules[functions[0].__module__])
    stub = stub_source(spec)
    header = "".join(stub.splitlines(True)[:min(n.lineno for n in ast.parse(stub).body if isinstance(n, ast.FunctionDef)) - 1])
    defined = set(spec.FUNCTIONS) | {(a.asname or a.name).split(".")[0] for node in ast.parse(header).body
                                     if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    bodies, imports = [], []
    while functions:
        fn = functions.pop(0)
        bodies.append(textwrap.dedent(inspect.getsource(fn)))
        for name in sorted(global_names(fn.__code__) - defined):
            value = fn.__globals__.get(name)
            alias, defined = "" if name == getattr(value, "__name__", name) else f" as {name}", defined | {name}
            if isinstance(value, ModuleType):
                imports.append(f"import {value.__name__}{alias}")
            elif isinstance(value, types.FunctionType) and value.__module__.startswith("exercises."):
                functions.append(value)    # a stored solution's helper: its source, not an import
            elif getattr(value, "__name__", None) and getattr(value, "__module__", None):
                imports.append(f"from {value.__module__} import {value.__name__}{alias}")
    return header.rstrip() + "\n" + "".join(f"{line}\n" for line in imports) + "\n\n" + "\n\n".join(bodies)


def global_names(code):
    return set(code.co_names).union(*(global_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


# -----------------------------------------------------------------------------
# The guard: while the answer's code runs, each refused function's code raises

STATE = SimpleNamespace(active=False, labels=[], refusals=[])   # refusals: all raised (an answer may catch one)


def refused_functions(spec):
    """{function: why}: the reference's functions and FORBIDDEN's, unwrapped (a decorated method's own code)."""
    found = {inspect.unwrap(getattr(spec.REFERENCE, f)): "the reference answer of this exercise" for f in spec.FUNCTIONS}
    return {**found, **{inspect.unwrap(fn): why for fn, why in getattr(spec, "FORBIDDEN", {}).items()}}


@contextlib.contextmanager
def guarding(spec):
    """Each refused function's __code__ swapped for code that raises Refused, and restored afterwards: a function
    captured before the check (f = Orthros.forward at import time, a bound method) refuses too."""
    if STATE.active:   # the answer calling its own functions
        yield
        return
    saved, STATE.active = [], True
    try:
        for fn, why in refused_functions(spec).items():
            STATE.labels.append((label(fn), why))
            saved.append((fn, fn.__code__))
            fn.__code__ = refusing_code(len(fn.__code__.co_freevars), len(saved) - 1, fn.__code__.co_name)
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code
        STATE.active, STATE.labels = False, []


def refuse(i):
    """What a refused function does while the answer's code runs."""
    STATE.refusals.append(Refused(f"your code called {STATE.labels[i][0]} ({STATE.labels[i][1]}), which the checker "
                                  "refuses while your code runs"))
    raise STATE.refusals[-1]


@functools.lru_cache(maxsize=None)
def refusing_code(n_free, i, name):
    """Code that calls refuse(i), with n_free free variables (a function's new __code__ must keep their number)."""
    free = [f"_{k}" for k in range(n_free)]
    lines = ["def outer():", f"    {' = '.join(free + ['None'])}", "    def refused(*args, **kwargs):",
             f"        ({', '.join(free)},)" if free else "        pass",
             f"        __import__('exercises.framework', fromlist=['refuse']).refuse({i})", "    return refused"]
    namespace = {}
    exec("\n".join(lines), namespace)
    return namespace["outer"]().__code__.replace(co_name=name)


def guarded(spec, answer):
    """The answer's functions as a case's call sees them: run under the guard; what they raise is marked as the
    answer's (a checker_hook's errors stay the checker's); a refusal they caught fails all the same."""
    def wrap(fn):
        @functools.wraps(fn)
        def answer_function(*args, **kwargs):
            if STATE.active:
                return fn(*args, **kwargs)
            refusals = len(STATE.refusals)
            try:
                with guarding(spec):
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
    """Checker code that runs inside the answer's call (a forward hook): what it raises is the checker's error (a
    Wrong: the answer's failure, in words), never "your code raised"."""
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
    """Around the checker's code that uses what the answer returned (runs the model it built, hands its t_out to
    orthros.py): what that raises is the answer's failure, "<what> raised ...", not the checker's."""
    try:
        yield
    except Exception as e:
        if isinstance(e, (Wrong, NotReady, Refused)) or getattr(e, "by_answer", False):
            raise
        raise Wrong(f"{what} raised {one_line(e)}") from e


# -----------------------------------------------------------------------------
# Running the cases

def check(spec, impl, summary=True, **options):
    """Run spec's cases on impl (an Answer, the reference, a Bug, a Mutant or a namespace), smallest first, in one
    CPU thread (the models are tiny; on a busy machine a second thread only waits); then, with summary, what
    spec.after_pass says."""
    threads, start = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)
    try:
        result = run_cases(spec, impl, summary, options)
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - start
    return result


def run_cases(spec, impl, summary, options):
    case, skipped = None, 0
    try:
        answer = as_answer(spec, impl)
        if answer.problem or not answer.started:
            return Result("FAIL", f"FAIL. {answer.problem}") if answer.problem else Result("not started", not_started(answer.path))
        functions = guarded(spec, answer)
        for i, case in enumerate(cases_of(spec, options)):
            if case.device not in (None, "cpu", "meta") and not torch.cuda.is_available():
                skipped += 1
                continue
            truth = truth_of(spec, case, i, options)
            outcome = run_case(spec, case, functions, truth)
            if outcome.kind == "not started":
                return Result("not started", not_started(answer.path, outcome.output))
            if outcome.problem:
                named = [] if answer.trusted else [bug for bug in spec.BUGS if same_failure(spec, bug, case, truth, outcome)]
                return Result("FAIL", failure(case, outcome, truth, named), named=[bug.name for bug in named])
        case, extra = None, ""
        try:
            extra = spec.after_pass(functions, **options) if summary and hasattr(spec, "after_pass") else ""
        except (NotReady, CheckerError):
            raise
        except Exception as e:
            if not getattr(e, "by_answer", False):
                raise CheckerError(e) from e
            extra = f"(The summary after the checks could not run: your code raised {one_line(e)}{answer_line(e)})"
    except NotReady as e:
        return Result("waiting", str(e))
    except CheckerError as e:
        return Result("ERROR", checker_failure(case, e.args[0]))
    return Result("PASS", extra + (f"\n({skipped} case(s) skipped: their device is not on this machine)" if skipped else ""))


CACHE = {}   # what the checks of one process share: each spec's cases, built once, and their truths
POOL = {}    # id(case) -> inputs an answer's run left as they were made (a deep copy of a model costs many forwards)


def cases_of(spec, options):
    """spec.cases(**options), each built when a check first reaches it (a check that stops early in a generator builds
    no more), and kept for the next checks: [spec (its id stays its own), the generator, the cases built, truths]."""
    cached = CACHE.setdefault((id(spec), repr(sorted(options.items()))), [spec, iter(spec.cases(**options)), [], {}])
    for i in itertools.count():
        if i == len(cached[2]):
            cached[2].append(next(cached[1], None))
        if cached[2][i] is None:
            cached[2].pop()
            return
        yield cached[2][i]


def truth_of(spec, case, i, options):
    """The right output, once: expected(**inputs), or the reference's call, on its own copy of the inputs."""
    truths = CACHE[id(spec), repr(sorted(options.items()))][3]
    if i not in truths and not (case.holds and not case.expected):
        inputs = fresh(case)
        try:
            truths[i] = case.expected(**inputs) if case.expected else \
                case.call(SimpleNamespace(**{f: getattr(spec.REFERENCE, f) for f in spec.FUNCTIONS}), **inputs)
        except (NotReady, KeyboardInterrupt):
            raise
        except Exception as e:
            raise CheckerError(e) from e
    return truths.get(i)


def run_case(spec, case, functions, truth):
    """The answer's outcome on the case: what its call gave, judged, and whether it changed its inputs."""
    inputs = POOL.pop(id(case), None) or fresh(case)
    before = {name: snapshot(value) for name, value in inputs.items()}
    outcome = outcome_of(case, functions, inputs)
    try:
        if outcome.kind == "value":
            outcome.problem = case.holds(outcome.output) if case.holds else \
                form_difference(outcome.output, truth, case.output) or value_difference(outcome.output, truth, case.atol, case.rtol)
        changed = changes(spec, before, inputs, case.mutable)
    except Exception as e:
        raise CheckerError(e) from e
    if not changed and not case.mutable:
        POOL[id(case)] = inputs   # still as fresh() made them: the next run of the case takes them
    if changed:
        outcome.problem, outcome.kind = (f"{outcome.problem}\n  and: {changed}" if outcome.problem else changed), \
            outcome.kind if outcome.problem else "changed"
    return outcome


def outcome_of(case, functions, inputs):
    try:
        return Outcome(case.call(functions, **inputs))
    except (NotReady, CheckerError):
        raise
    except Wrong as e:
        return Outcome(problem=str(e), kind="wrong")
    except Refused as e:
        return Outcome(problem=f"refused: {e}{answer_line(e)}", kind="raised")
    except Exception as e:
        if not getattr(e, "by_answer", False):
            raise CheckerError(e) from e
        if isinstance(e, NotImplementedError) and not str(e):
            return Outcome(e, kind="not started")
        return Outcome(problem=f"your code raised {one_line(e)}{answer_line(e)}", kind="raised")


def same_failure(spec, bug, case, truth, outcome):
    """Does the known bug fail this case with the same report (its file's line numbers aside)?"""
    answer = as_answer(spec, bug)
    try:
        theirs = run_case(spec, case, guarded(spec, answer), truth) if not answer.problem else Outcome()
    except CheckerError:
        return False
    unplaced = lambda text: re.sub(r" \(at [^()]*, line \d+\)", "", text or "")
    return bool(theirs.problem) and theirs.kind == outcome.kind and unplaced(theirs.problem) == unplaced(outcome.problem)


def fresh(case):
    """A deep copy of case.inputs(), built on the case's device and converted to its dtype."""
    try:
        with torch.device(case.device) if case.device else contextlib.nullcontext():
            inputs = case.inputs()   # tensors made here are made on the case's device (meta: no memory)
        return {name: place(value, case.device, case.dtype) for name, value in copy.deepcopy(inputs).items()}
    except (NotReady, KeyboardInterrupt):
        raise
    except Exception as e:
        raise CheckerError(e) from e


def place(value, device, dtype):
    if isinstance(value, (torch.Tensor, nn.Module)):
        value = value.to(device) if device else value
        return value.to(dtype) if dtype and (isinstance(value, nn.Module) or value.is_floating_point()) else value
    if isinstance(value, (list, tuple)):
        return type(value)(place(v, device, dtype) for v in value)
    return {k: place(v, device, dtype) for k, v in value.items()} if isinstance(value, dict) else value


# -----------------------------------------------------------------------------
# Untouched inputs: a snapshot before the call, compared with each input after it

Kept = collections.namedtuple("Kept", "kind value requires_grad", defaults=[False])   # a tensor's copy, or a container's parts


def snapshot(x):
    if isinstance(x, torch.Tensor):
        return Kept(torch.Tensor, x.detach() if x.device.type == "meta" else x.detach().clone(), x.requires_grad)
    found = parts(x)
    return x if found is None else Kept(type(x), {key: snapshot(part) for key, part in found.items()})


def parts(x):
    """A container's parts by the path that reaches each, or None for a plain value: a module's weights (with
    requires_grad), its submodules' public attributes (mode, config, settings) and their number of hooks."""
    if isinstance(x, nn.Module):
        found = {f".{k}": v for k, v in x.state_dict(keep_vars=True).items()}
        for name, module in x.named_modules():
            prefix = f"{'.' * bool(name)}{name}"
            found.update({f"{prefix}.{k}": v for k, v in vars(module).items() if not k.startswith("_")})
            found[f"{prefix}.hooks"] = sum(len(v) for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict))
        return found
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f".{f.name}": getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, (dict, list, tuple)):
        return {f"[{k!r}]": v for k, v in (x.items() if isinstance(x, dict) else enumerate(x))}
    if hasattr(x, "__dict__") and not isinstance(x, (type, ModuleType)) and not callable(x):
        return {f".{k}": v for k, v in vars(x).items() if not isinstance(v, weakref.ref)}
    return None


def changes(spec, before, after, mutable=()):
    """What the answer changed among its inputs, in words, or None."""
    who = f"your {spec.FUNCTIONS[0]}" if len(spec.FUNCTIONS) == 1 else "your code"
    for name, old in before.items():
        found = None if name in mutable else difference_in(old, after[name])
        if found:
            path, what = found
            return f"{who} changed its input `{name}`" + (f" {what[len('changed '):]}" if not path else f": `{name}{path}` {what}")
    return None


def difference_in(old, new, path=""):
    """(where, what) for the first difference between an input's snapshot before the call and the input after it."""
    if isinstance(old, Kept) and old.kind is torch.Tensor:
        was = old.value
        if not isinstance(new, torch.Tensor) or (was.shape, was.dtype, was.device) != (new.shape, new.dtype, new.device):
            return path, f"was {describe(was)}, now {describe(new)}"
        if old.requires_grad != new.requires_grad:
            return f"{path}.requires_grad", f"was {old.requires_grad}, now {new.requires_grad}"
        differ = (was != new) & ~(was.isnan() & new.isnan()) if was.device.type != "meta" else torch.zeros(())
        return (path, f"changed in place ({int(differ.sum())} of {was.numel()} entries differ)") if differ.any() else None
    if not isinstance(old, Kept):
        try:
            same = old is new or bool(old == new) or (old != old and new != new)
        except Exception:
            same = False
        return None if same else (path, f"was {short(old, 60)}, now {short(new, 60)}")
    new_parts = parts(new)
    if new_parts is None or type(new) is not old.kind:
        return path, f"was {article(old.kind.__name__)}, now {describe(new)}"
    for key, part in old.value.items():
        found = difference_in(part, new_parts[key], path + key) if key in new_parts else (path + key, "is gone")
        if found:
            return found
    extra = [key for key in new_parts if key not in old.value]
    return (path + extra[0], "is new: it was not there before") if extra else None


# -----------------------------------------------------------------------------
# Forms and values, in words

def form_difference(out, ref, label="your output"):
    """None when out has ref's form (its type; a tensor's shape, dtype and device; a tuple's or list's length, a
    dict's keys, and their items' forms), else what differs, in words. Never looks at out's values."""
    be, have = ("are", "have") if re.search(r"[^s]s$", label.split()[-1]) else ("is", "has")
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return f"{label} {be} {describe(out)}, expected {describe(ref)}"
        for what, mine, theirs in (("shape", tuple(out.shape), tuple(ref.shape)), ("dtype", out.dtype, ref.dtype)):
            if mine != theirs:
                return f"{label} {have} {what} {mine}, expected {theirs}"
        return None if out.device.type == ref.device.type else f"{label} {be} on {out.device.type}, expected {ref.device.type}"
    if isinstance(ref, (tuple, list, dict)):
        keys = ref if isinstance(ref, dict) else range(len(ref))
        if not isinstance(out, dict if isinstance(ref, dict) else (tuple, list)) or len(out) != len(ref):
            return f"{label} {be} {describe(out)}, expected {describe(ref)}"
        if isinstance(ref, dict) and set(out) != set(ref):
            return (f"{label} {have} the keys {short(sorted(map(str, set(out) - set(ref))), 100)} too many, "
                    f"{short(sorted(map(str, set(ref) - set(out))), 100)} missing")
        return next(filter(None, (form_difference(out[k], ref[k], f"{label}[{k!r}]" if isinstance(ref, dict) else
                                                  f"item {k} of {label}") for k in keys)), None)
    if isinstance(ref, float) and type(out) is int or type(out) is type(ref):
        return None
    if isinstance(ref, (bool, int, float, str, type(None))) or not isinstance(out, type(ref)):
        return f"{label} {be} {describe(out)}, expected {article(type(ref).__name__)}"
    return None


def value_difference(out, ref, atol=0.0, rtol=0.0):
    """None when out's values equal ref's (to atol/rtol), else the first difference, in words (out has ref's form)."""
    if isinstance(ref, (dict, list, tuple)):
        for k in (ref if isinstance(ref, dict) else range(len(ref))):
            problem = value_difference(out[k], ref[k], atol, rtol)
            if problem:
                return f"at [{k!r}]: {problem}" if isinstance(ref, dict) else f"at item {k}: {problem}"
        return None
    if isinstance(ref, torch.Tensor):
        return tensor_difference(out, ref, atol, rtol)
    close = math.isclose(out, ref, rel_tol=rtol, abs_tol=atol) if isinstance(ref, float) else out == ref
    return None if close else f"yours {short(out)}, the reference {short(ref)}"


def tensor_difference(out, ref, atol, rtol):
    if "meta" in (out.device.type, ref.device.type):
        return None   # no values on meta: the form is all there is
    out, ref = out.detach().cpu(), ref.detach().cpu()
    bad = ~torch.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    gap = torch.where(bad, (out.double() - ref.double()).abs().nan_to_num(nan=math.inf), -1.0)
    at = tuple(int(i) for i in numpy.unravel_index(int(gap.argmax()), gap.shape))   # (torch's would import sympy)
    text = f"{int(bad.sum())} of {bad.numel()} entries differ"
    if not ref.is_floating_point():
        return f"{text}; the first at index {at}: yours {out[at].item()}, the reference {ref[at].item()}"
    digits = 6 if f"{out[at].item():.6g}" != f"{ref[at].item():.6g}" else 12
    rounding = " (about float32's rounding: does a step go through float32?)" \
        if ref.dtype == torch.float64 and 1e-12 < gap[at] <= 1e-6 * max(1.0, abs(ref[at].item())) else ""
    return (f"{text}; the largest difference, {gap[at]:.3g}{rounding}, at index {at}: yours {out[at].item():.{digits}g}, "
            f"the reference {ref[at].item():.{digits}g}; allowed {atol:g}" + (f" + {rtol:g} x |reference|" if rtol else ""))


def describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    scalar = isinstance(value, (bool, int, float, str, type(None)))
    return article(type(value).__name__) + (f" ({short(value, 60)})" if scalar else "")


def article(name):
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


def short(x, limit=160):
    text = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) and x.numel() > 8 else \
        repr(x.tolist() if isinstance(x, torch.Tensor) else x)
    return text if len(text) <= limit else text[:limit] + " ..."


def one_line(error):
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} (line {error.lineno})"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def label(fn):
    return f"{fn.__module__}.{fn.__qualname__}"


# -----------------------------------------------------------------------------
# Reports

def relpath(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except (ValueError, OSError):
        return str(path)


def answer_line(error):
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in ANSWER_FILES]
    return f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""


def not_started(path, error=None):
    where, name = relpath(path), ""
    if error is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        name, where = f"`{frame.name}` in ", relpath(frame.filename)
    how = f"Start it with `python -m exercises start {int(Path(path).name[2:4])}` (it copies the stub to exercises/mine/), " \
        "then open that file, read its docstring, and write it." if Path(path).resolve().parent == STUBS else \
        "Open the file, read its docstring, and write it."
    return f"not started: {name}{where} still raises NotImplementedError. {how}"


def failure(case, outcome, truth, named):
    lines = ["FAIL. The smallest failing case:", f"  {case.what}", f"  what is wrong: {outcome.problem}"]
    masks = [outcome.output, truth]
    if all(isinstance(m, torch.Tensor) and m.dtype == torch.bool and m.dim() == 2 and max(m.shape) <= 24
           and m.device.type != "meta" and m.shape == truth.shape for m in masks):
        lines.append("  yours" + " " * (truth.size(1) + 2) + "the reference   (rows: queries, columns: keys; # = attends)")
        lines += [f"  {a}       {b}" for a, b in zip(*(["".join(".#"[v] for v in row) for row in m.tolist()] for m in masks))]
    lines.append(f"  the invariant it breaks: {case.invariant}")
    return "\n".join(lines + [f"  This behaves like a known mistake: {bug.name}. {bug.expect}" for bug in named])


def checker_failure(case, error):
    frames = traceback.extract_tb(error.__traceback__)
    frames = [f for f in frames if f.filename.startswith(str(HERE))] or frames
    where = f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    return (f"ERROR. The checker's own code failed on this case, not your code:\n  {case.what if case else 'after the cases'}"
            f"\n  {one_line(error)}{where}\n  This is a bug in the checker: please show this message to your teacher.")


# -----------------------------------------------------------------------------
# What the checks share: tiny models drawn in float64, inputs, patching, a look at what the blocks are handed

def tiny_model(attn="orthros", seed=0, dtype=torch.float64, **overrides):
    """A tiny model in eval mode, its weights drawn in dtype (float64: values float32 cannot hold), its scale-offsets
    and optional convolution moved off their identity start (the two streams' queries differ)."""
    config = orthros.OrthrosConfig(**{**dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4, attn=attn,
                                             max_seq_len=512), **overrides})
    default = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        model = orthros.Orthros(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.rsplit(".", 1)[-1] in orthros.SCALE_OFFSETS or name.endswith("conv.weight"):
                    p.add_(0.5 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(default)
    return model


def tokens(B, T, vocab=37, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def handed_to_blocks(model, B, rows, T, why, more=None):
    """Check what the answer hands each of model.blocks before the block's own code (and its assertions) runs: z of
    shape (B, rows, C) (rows None: any), T, and more(block index, the block's arguments) -> None or what is wrong."""
    def check(block, args, kwargs):
        given = inspect.signature(block.forward).bind(*args, **kwargs).arguments
        z, i = given.get("z"), list(model.blocks).index(block)
        shape = (B, rows or getattr(z, "shape", (0, "rows"))[1], model.config.n_embd)
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != shape:
            raise Wrong(f"your code hands block {i} z of {describe(z)[2:]}, expected shape {shape}: {why}")
        if given.get("T") != T:
            raise Wrong(f"your code hands block {i} T={given.get('T')!r}, expected {T}: T counts the base tokens, the "
                        f"first T rows of z ({why})")
        problem = more and more(i, given)
        if problem:
            raise Wrong(f"your code hands block {i} {problem}")
    hooks = [block.register_forward_pre_hook(checker_hook(check), with_kwargs=True) for block in model.blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
