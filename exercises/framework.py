"""The checker every exercise shares: cases run live against the real code, the reference first;
the smallest failing case reported with its largest difference and the invariant it breaks;
known mistakes named; inputs checked untouched; shortcuts refused.

An exercise's checks module (exercises/checks/exNN_*.py) declares:
  TITLE, DIFFICULTY (1-5), MINUTES, TEACHES   for the syllabus
  FUNCTIONS    the names the student writes in exercises/exNN_*.py
  REFERENCE    a namespace of the right functions: orthros.py's (or perf/bench.py's) own for a
               "replace" exercise, a stored solution (exercises/solutions/) for a "build" one
  FORBIDDEN    optional {function: why}: what an answer may not call (e.g. Orthros.forward when
               the exercise builds it). The reference, the stored solutions and the checker's own
               functions are refused anyway (see Guard).
  RETURNS      optional {function name: "logits"} or {name: ("logits", "cache")}: what each
               function returns, in words, for the reports ("your logits have shape ...")
  HINTS        the idea, then the shapes or pseudocode, then the paper's line
  BUGS         known mistakes (Bug): each must FAIL, and the report names it
  MUTANTS      optional, further wrong answers (Mutant): each must FAIL (the report need not name it)
  cases(**options)   the cases (Case), smallest first
  after_pass(answer, **options)   optional: what to print once everything passes

How one case runs (run_case):
  1. the truth: REFERENCE runs through case.call on its own copy of case.inputs(); the form of
     everything each of its functions returns is recorded; the expected output is
     case.expected(**that copy) if given, else what the reference's call returned;
  2. the answer runs through case.call on a fresh copy of the inputs, under the guard: each of its
     functions' returns is compared in form (type, shape, dtype, device) with the reference's
     before the checker's code touches it; then the output: form first, then values;
  3. the inputs the answer received must come back unchanged (tensors by value, models' weights,
     modes and settings, configs, caches), except those the case names as mutable.
check() runs the cases in order and stops at the first that fails: that is the smallest.

Writing a case (see exercises/checks/ for many):
    Case("attended_pairs(T=5, window=2)",                 # what, in words a student can re-run
         inputs=lambda: dict(T=5, window=2, n_q=None),    # named inputs; shared objects are fine:
                                                          #   every run deep-copies them
         call=lambda answer, T, window, n_q: answer.attended_pairs(T, window, n_q),
         invariant="query t sees min(t + 1, w) keys",
         expected=None,       # or (**inputs) -> the truth, when it is not the reference's output
         atol=0.0,            # exact; 1e-12 for float64 against a different summation order
         device=None,         # "meta": paper-size shapes at no memory (values are not compared; the
                              #   first elementwise op on meta imports torch._dynamo, ~1.7 s once per
                              #   process on 2 CPU cores: put such cases last); "cuda": skipped without one
         dtype=None)          # e.g. torch.float32: floating inputs (tensors, modules) converted
  A call may use what the answer returns (pass its cache to the next step, run the model it
  built): each return is checked in form first; wrap further use in `with using("your model(idx)")`
  so that what it raises is the answer's failure. A call must not change with the answer: call the
  same functions in the same order as it does for the reference.
A known bug: Bug(name, why, impl=variant(REFERENCE, f=wrong_f)), a copy of the reference with one
mistake; it must fail, and the report names it wherever an answer fails the same way. A mutant:
Mutant(name, impl=SimpleNamespace(f=...) or source="<a whole student file>", expect="words of the
report"), a wrong answer that must fail with those words: a hard-coded size, a wrong dtype, an input
changed in place, a refused shortcut (source= for what happens at import: `from orthros import f`,
`f = Orthros.forward`). A source= answer is treated exactly as a student's file. Functions given as
impl= may call the reference's (a bug is the reference with one mistake), but no other function of the
checker while they run, unless it is marked @student_side (factories run at import are fine).
"""

import ast
import builtins
import contextlib
import copy
import dataclasses
import importlib
import importlib.abc
import inspect
import linecache
import math
import subprocess
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

import torch
import torch.nn as nn

import orthros

REPO = Path(__file__).resolve().parents[1]
STUBS = REPO / "exercises"            # the stubs, as the class receives them
MINE = REPO / "exercises" / "mine"    # each student's answers, git-ignored: python -m exercises start N

ORDER = ["ex01_window_mask", "ex02_two_streams", "ex03_t_out_regimes", "ex04_algorithm1", "ex05_conversion",
         "ex06_reach", "ex07_prefill_flops", "ex08_blocked_window", "ex09_decode_step", "ex10_recall_lab"]


@dataclass
class Case:
    what: str              # the inputs and the call, in words: the case a student re-runs by hand
    inputs: Callable       # () -> {name: value}; each run gets its own deep copy
    call: Callable         # (answer, **inputs) -> output: calls the answer's functions (answer.f(...))
    invariant: str         # what the reference satisfies here, in words
    atol: float = 0.0      # 0: exact (booleans, integers, copies)
    expected: Callable = None   # (**inputs) -> the right output, when it is not what the reference's call returns
    holds: Callable = None      # output -> None, or what is wrong: a property instead of a reference output
    device: str = None     # where the case runs: inputs() runs under `with torch.device(device)`, and the
    #                        tensors and modules it returns are moved there; a device this machine lacks
    #                        (cuda) skips the case; on "meta" only forms compare (paper sizes cost nothing)
    dtype: torch.dtype = None   # floating tensors and modules of the inputs are converted to it
    output: str = None     # the output in words, for the report ("your logits, one per decode step")
    mutable: tuple = ()    # inputs the answer may change (e.g. a cache it appends to)
    trace: bool = True     # run the reference first (False: no per-call form check; needs expected or holds)


@dataclass
class Bug:
    name: str              # the classic mistake, in a few words
    why: str               # what it breaks
    impl: SimpleNamespace = None   # the reference's FUNCTIONS with the mistake in one of them
    source: str = None     # or: the text of a whole student file, loaded as one


@dataclass
class Mutant:
    name: str              # the wrong answer, in a few words
    impl: SimpleNamespace = None
    source: str = None     # the text of a whole student file (needed for what happens at import)
    expect: str = ""       # words the FAIL report must contain, e.g. "changed its input `q`"


@dataclass
class Result:
    status: str            # "PASS", "FAIL", "not started", "waiting" (for training runs) or "ERROR" (the checker's)
    message: str = ""
    seconds: float = 0.0
    named: list = field(default_factory=list)   # the known bugs the answer behaves like
    skipped: list = field(default_factory=list)  # the cases skipped (a device this machine lacks)


class NotReady(Exception):
    """Something the check needs is not there yet (e.g. the recall lab's trained runs)."""


class Refused(Exception):
    """An answer called something its exercise refuses: the reference, a stored solution, the checker."""


class WrongForm(Exception):
    """What an answer's function returned has the wrong type, shape, dtype or device."""


class Wrong(Exception):
    """Raised by a case's call when what the answer returned cannot be used (e.g. orthros.py refuses the
    t_out it computed): the case fails with this message."""


class NotStarted(Exception):
    pass


class Raised:
    """An exception the answer's code raised, kept as its output so that it can be compared and shown."""

    def __init__(self, error):
        self.error = error
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in ANSWER_FILES]
        self.where = f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""

    def __repr__(self):
        if isinstance(self.error, Refused):
            return f"refused: {self.error}{self.where}"
        return f"raised {type(self.error).__name__}: {self.error}{self.where}"


ANSWER_FILES = set()   # the files answers were loaded from: their frames are the student's


# -----------------------------------------------------------------------------
# Answers: what a check runs

class Answer:
    """The functions under check (FUNCTIONS, by name) and where they come from. kind: "student"
    (a file: exercises/mine/, a stub, or a source mutant), "reference", or "bug" (a known
    mistake or a mutant given as functions). problem: why it cannot run at all (it does not
    import, or holds a shortcut)."""

    def __init__(self, functions, kind, path=None, problem=None, started=True):
        self.functions, self.kind, self.path, self.problem, self.started = functions, kind, path, problem, started

    def __getattr__(self, name):
        functions = self.__dict__.get("functions", {})
        if name in functions:
            return functions[name]
        raise AttributeError(name)


def reference_kind(fn):
    """"replace" when the reference is the repo's own function, "build" when it is a stored solution."""
    return "build" if inspect.unwrap(fn).__module__.startswith("exercises") else "replace"


def kind(spec):
    return " + ".join(dict.fromkeys(reference_kind(getattr(spec.REFERENCE, name)) for name in spec.FUNCTIONS))


def load_spec(n):
    return importlib.import_module(f"exercises.checks.{ORDER[n - 1]}")


def load(n, solution=False, path=None):
    """(spec, answer): exercise n's checks module and what to check: the reference (solution=True),
    the file at path, or the student's file (answer_file(n))."""
    spec = load_spec(n)
    if solution:
        return spec, spec.REFERENCE
    path = Path(path) if path else answer_file(n)
    return spec, load_answer(spec, path.read_text(), path)


def answer_file(n):
    """The file `check n` reads: the student's exercises/mine/exNN_*.py once `start n` made it,
    else the stub exercises/exNN_*.py (which a student may also have edited in place)."""
    mine = MINE / f"{ORDER[n - 1]}.py"
    return mine if mine.is_file() else STUBS / f"{ORDER[n - 1]}.py"


def committed_stub(n):
    """The stub's text as committed (git show HEAD:...), whatever a student did to the working file;
    the working file where there is no git, or the file is not committed yet."""
    path = REPO / "exercises" / f"{ORDER[n - 1]}.py"
    try:
        shown = subprocess.run(["git", "show", f"HEAD:./exercises/{path.name}"], cwd=REPO,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return path.read_text()
    return shown.stdout if shown.returncode == 0 else path.read_text()


_loaded = 0


def load_answer(spec, source, filename):
    """Run a student file's text as a module, under the guard (imports of exercises.* refused, the
    refused functions raising), and check that nothing in it holds a shortcut."""
    global _loaded
    _loaded += 1
    filename = str(filename)
    name = f"_exercise_answer_{_loaded}_{Path(filename).stem}"
    module = ModuleType(name)
    module.__file__ = filename
    ANSWER_FILES.add(filename)
    if not Path(filename).is_file() or Path(filename).read_text() != source:  # tracebacks show this text
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    sys.modules[name] = module   # for what needs its module (dataclasses, pickle)
    with GUARD.installed(spec):
        try:
            code = compile(source, filename, "exec")
            with GUARD.running():
                exec(code, module.__dict__)
        except NotImplementedError as e:
            if not str(e):   # a module-level `raise NotImplementedError`: treat as not started
                return Answer({}, "student", filename, started=False)
            return Answer({}, "student", filename, f"{relpath(filename)} does not import: {one_line(e)}")
        except Exception as e:  # a syntax error, a refused import: report it
            return Answer({}, "student", filename, f"{relpath(filename)} does not import: {one_line(e)}")
        missing = [f for f in spec.FUNCTIONS if not callable(getattr(module, f, None))]
        if missing:
            return Answer({}, "student", filename, f"{relpath(filename)} has no function `{missing[0]}`: "
                          "keep the stub's name and signature")
        functions = {f: getattr(module, f) for f in spec.FUNCTIONS}
        return Answer(functions, "student", filename, held_shortcut(module, functions, filename))


def as_answer(spec, impl):
    if isinstance(impl, Answer):
        return impl
    if isinstance(impl, (Bug, Mutant)):
        if impl.source is not None:
            return load_answer(spec, impl.source, f"<{'known bug' if isinstance(impl, Bug) else 'mutant'}: {impl.name}>")
        impl = impl.impl
    functions = {name: getattr(impl, name, None) for name in spec.FUNCTIONS}
    if isinstance(impl, ModuleType):   # a student module imported some other way
        path = getattr(impl, "__file__", None)
        return Answer(functions, "student", path, held_shortcut(impl, functions, path))
    return Answer(functions, "reference" if impl is spec.REFERENCE else "bug")


def one_line(error):
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, SyntaxError):
        text = f"SyntaxError: {error.msg} (line {error.lineno})"
    return text.splitlines()[0] if text.strip() else type(error).__name__


def held_shortcut(module, functions, filename):
    """Why the answer is refused before it runs: its module's globals, or its functions' defaults
    or closures, hold something refused (a reference function, a method that does the work, a
    stored solution, the checker)."""
    refused = GUARD.refused_objects()
    where = relpath(filename) if filename else "your file"
    held = [(f"the name `{name}` in {where}", value) for name, value in vars(module).items()
            if not name.startswith("__")]
    for fname, fn in functions.items():
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                held.append((f"the closure of your `{fname}`", cell.cell_contents))
            except ValueError:
                pass
        for value in (getattr(fn, "__defaults__", None) or ()) + tuple((getattr(fn, "__kwdefaults__", None) or {}).values()):
            held.append((f"a default argument of your `{fname}`", value))
    for what, value in held:
        if isinstance(value, ModuleType) and _is_exercises_module(value.__name__):
            return f"{what} is the module {value.__name__}: the solutions and the checker are not yours to use"
        target = getattr(value, "__func__", value)
        try:
            target = inspect.unwrap(target) if callable(target) else target
        except Exception:
            pass
        if id(target) in refused:
            label, why = refused[id(target)]
            return (f"{what} holds {label}, which this exercise refuses ({why}). Remove that import or "
                    "reference: the checker compares your own code with it.")
    return None


def _is_exercises_module(name):
    return name == "exercises" or name.startswith("exercises.")


def solved_source(n):
    """A whole file that solves exercise n: the stub's docstring and imports, the reference's
    functions, and the imports those need. For teachers (`solution N --show`) and for the tests."""
    spec = load_spec(n)
    stub = committed_stub(n)
    tree = ast.parse(stub)
    first_def = min(node.lineno for node in tree.body if isinstance(node, ast.FunctionDef))
    header = "\n".join(stub.splitlines()[:first_def - 1]).rstrip() + "\n"
    defined = set(spec.FUNCTIONS)
    for node in ast.parse(header).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    imports, bodies = [], []
    for name in spec.FUNCTIONS:
        fn = inspect.unwrap(getattr(spec.REFERENCE, name))
        bodies.append(textwrap.dedent(inspect.getsource(fn)))
        for used in sorted(global_names(fn.__code__)):
            if used in defined or used not in fn.__globals__ or hasattr(builtins, used):
                continue
            value = fn.__globals__[used]
            if isinstance(value, ModuleType):
                imports.append(f"import {value.__name__}" if used == value.__name__ else f"import {value.__name__} as {used}")
            elif getattr(value, "__module__", None) and getattr(value, "__name__", None):
                alias = "" if used == value.__name__ else f" as {used}"
                imports.append(f"from {value.__module__} import {value.__name__}{alias}")
            defined.add(used)
    return header + "".join(f"{line}\n" for line in imports) + "\n\n" + "\n\n".join(bodies)


def global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


# -----------------------------------------------------------------------------
# The guard: what an answer may not reach while its code runs

def student_side(fn):
    """Mark a checks-module helper that runs as part of an answer (a mutant's helper, a hook that fires
    inside the answer's code): the guard leaves it callable while an answer runs."""
    fn.student_side = True
    return fn


def shortcuts(spec):
    """(function, label, why) for everything exercise spec refuses an answer: the reference's
    functions, spec.FORBIDDEN, every stored solution's functions, the checker's own functions."""
    found = [(getattr(spec.REFERENCE, name), "the reference answer of this exercise") for name in spec.FUNCTIONS]
    found += list(getattr(spec, "FORBIDDEN", {}).items())
    loaded = [(name, module) for name, module in list(sys.modules.items()) if module is not None]
    for name, module in loaded:   # an answer cannot import more of them, nor reach those not loaded
        if name.startswith("exercises.solutions."):
            found += [(fn, "a stored solution (exercises/solutions/)") for fn in module_functions(module)]
    checks = [module for name, module in loaded if name.startswith("exercises.checks.")]
    for module in checks + [sys.modules[__name__]]:
        found += [(fn, "the checker's own code") for fn in module_functions(module)
                  if not getattr(fn, "student_side", False) and not fn.__name__.startswith("_")
                  and fn is not student_side]
    return [(fn, label(fn), why) for fn, why in found]


def module_functions(module):
    return [fn for fn in vars(module).values() if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__]


def label(fn):
    fn = inspect.unwrap(fn)
    module = getattr(fn, "__module__", "") or ""
    return f"{module}.{fn.__qualname__}" if module else fn.__qualname__


class Guard:
    """While an answer's code runs (`running()`), the refused functions raise Refused, and the modules
    of exercises/ (the solutions, the checks, this framework) are hidden and cannot be imported.

    The refused functions are patched in place: each one's __code__ is swapped for a trampoline
    that asks the guard first, so that a function captured before the check (`f = Orthros.forward`
    at import time, a bound method, a decorator's wrapped function) refuses too. The answer's own
    functions are exempt (the reference, when the reference is what is checked). Everything is
    restored when the check ends, whatever happens."""

    def __init__(self):
        self.active = False      # the answer's code is running
        self.entries = []        # (function, its own code, a callable copy, label, why)
        self.by_id = {}          # id(function) -> index into entries
        self.exempt = frozenset()
        self.refusals = []
        self.depth = 0
        self.hidden = {}
        self.modules = []

    @contextlib.contextmanager
    def installed(self, spec):
        if self.depth == 0:
            try:
                self._install(spec)
            except BaseException:
                self._uninstall()
                raise
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._uninstall()

    @contextlib.contextmanager
    def answering(self, answer, reference=None):
        """Exempt the answer's own functions; for the reference and the known bugs (the reference with
        one mistake), also the reference's functions and its solution module's."""
        functions = list(answer.functions.values())
        if answer.kind != "student" and reference is not None:
            functions += [getattr(reference, name) for name in answer.functions]
        functions = [inspect.unwrap(fn) for fn in functions if fn is not None]
        own = {id(fn) for fn in functions}
        if answer.kind != "student":
            modules = {fn.__module__ for fn in functions if "solutions" in fn.__module__}
            own |= {id(fn) for fn, *_ in self.entries if fn.__module__ in modules}
        old, self.exempt = self.exempt, frozenset(self.by_id[i] for i in own if i in self.by_id)
        try:
            yield
        finally:
            self.exempt = old

    @contextlib.contextmanager
    def running(self):
        """The answer's code runs inside: refuse, and hide exercises/ from it."""
        if self.active:
            yield
            return
        self.active = True
        for name in self.modules:
            if name in sys.modules:
                self.hidden[name] = sys.modules.pop(name)
        try:
            yield
        finally:
            sys.modules.update(self.hidden)
            self.hidden.clear()
            self.active = False

    def refused_objects(self):
        return {id(fn): (lbl, why) for fn, _, _, lbl, why in self.entries}

    def _install(self, spec):
        self.refusals = []
        builtins.__orthros_exercise_guard__ = self._call
        sys.meta_path.insert(0, _BLOCKER)
        found = shortcuts(spec)
        self.modules = [name for name in sys.modules if _is_exercises_module(name)]   # hidden while an answer runs
        for fn, lbl, why in found:
            fn = inspect.unwrap(fn)
            if not isinstance(fn, types.FunctionType) or id(fn) in self.by_id:
                continue
            own = fn.__code__
            callable_copy = types.FunctionType(own, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            callable_copy.__kwdefaults__ = fn.__kwdefaults__
            self.by_id[id(fn)] = len(self.entries)
            self.entries.append((fn, own, callable_copy, lbl, why))
            fn.__code__ = _trampoline(len(self.entries) - 1, len(own.co_freevars), fn.__name__)

    def _uninstall(self):
        for fn, own, *_ in self.entries:
            fn.__code__ = own
        self.entries, self.by_id, self.exempt = [], {}, frozenset()
        if _BLOCKER in sys.meta_path:
            sys.meta_path.remove(_BLOCKER)
        if hasattr(builtins, "__orthros_exercise_guard__"):
            del builtins.__orthros_exercise_guard__

    def _call(self, index, args, kwargs):
        fn, own, callable_copy, lbl, why = self.entries[index]
        if self.active and index not in self.exempt:
            error = Refused(f"your code called {lbl} ({why}), which the checker refuses while your code runs")
            self.refusals.append(error)
            raise error
        return callable_copy(*args, **kwargs)


def _trampoline(index, n_free, name):
    """A code object that hands the call to the guard: (*args, **kwargs) -> guard(index, args, kwargs).
    It has the original's number of free variables, as a function's __code__ must."""
    free = [f"_free{i}" for i in range(n_free)]
    lines = ["def _outer():"] + ([f"    {' = '.join(free)} = None"] if free else [])
    lines += ["    def _guarded(*args, **kwargs):"] + ([f"        ({', '.join(free)},)"] if free else [])
    lines += [f"        return __orthros_exercise_guard__({index}, args, kwargs)", "    return _guarded"]
    namespace = {}
    exec(compile("\n".join(lines), "<exercise guard>", "exec"), namespace)
    return namespace["_outer"]().__code__.replace(co_name=name)


class _ImportBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if GUARD.active and _is_exercises_module(name):
            raise ImportError(f"`{name}` is not available to your code while it is checked: exercises/ holds "
                              "the stored solutions and the checker. Write the function yourself.")
        return None


GUARD = Guard()
_BLOCKER = _ImportBlocker()


# -----------------------------------------------------------------------------
# Running the cases

def check(spec, impl, **options):
    """Run spec's cases on impl (an Answer, a module, or a namespace of functions), smallest first;
    stop at the first failure and name the known bugs that fail the same way. One thread: the models
    are tiny, and a second thread only waits (on a busy machine, e.g. while a recall run trains, it
    makes each forward ~100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        with GUARD.installed(spec):
            result = run_cases(spec, as_answer(spec, impl), **options)
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - start
    return result


def run_cases(spec, answer, **options):
    if not answer.started:
        return Result("not started", not_started(answer.path))
    if answer.problem:
        return Result("FAIL", f"FAIL. {answer.problem}")
    cases, truths, skipped = spec.cases(**options), {}, []
    for i, case in enumerate(cases):
        if not device_available(case.device):
            skipped.append(case.what)
            continue
        try:
            outcome = run_case(spec, case, answer, truths, i)
        except NotReady as e:
            return Result("waiting", str(e), skipped=skipped)
        except NotStarted as e:
            return Result("not started", not_started(answer.path, e.args[0]), skipped=skipped)
        except CheckerError as e:
            return Result("ERROR", checker_failure(case, e.error), skipped=skipped)
        if outcome.problem:
            named = [bug for bug in spec.BUGS if behaves_like(spec, bug, cases, truths, i, outcome)]
            return Result("FAIL", failure(case, outcome, truths[i], named), named=[bug.name for bug in named],
                          skipped=skipped)
    extra = ""
    if hasattr(spec, "after_pass"):
        try:
            with GUARD.answering(answer, spec.REFERENCE):
                extra = spec.after_pass(Wrapped(spec, answer, Run(spec, "answer")), **options)
        except NotReady as e:
            return Result("waiting", str(e), skipped=skipped)
        except Exception as e:
            extra = f"(The summary after the checks could not run: {one_line(e)})"
    if skipped:
        extra = (extra + "\n" if extra else "") + f"({len(skipped)} case(s) skipped: their device is not on this machine)"
    return Result("PASS", extra, skipped=skipped)


def device_available(device):
    if device is None or device in ("cpu", "meta"):
        return True
    kind = torch.device(device).type
    return kind == "cuda" and torch.cuda.is_available() or kind == "mps" and torch.backends.mps.is_available()


class CheckerError(Exception):
    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


@dataclass
class Truth:
    output: object         # the expected output (or a Raised)
    forms: dict            # function name -> the forms of the reference's returns, in call order


@dataclass
class Outcome:
    output: object = None  # what the answer's call gave (or a Raised)
    problem: str = None    # None: right
    kind: str = "value"    # "value", "raised", "form", "changed"


class Run:
    """One run of a case's call: records (truth) or checks (answer) the form of each return."""

    def __init__(self, spec, mode, forms=None):
        self.spec, self.mode, self.forms = spec, mode, forms if forms is not None else {}
        self.calls, self.depth = {}, 0

    def returned(self, name, value):
        k = self.calls[name] = self.calls.get(name, 0) + 1
        if self.mode == "truth":
            self.forms.setdefault(name, []).append(form_of(value))
            return
        expected = self.forms.get(name, [])
        if k <= len(expected):
            problem = form_difference(value, expected[k - 1], *return_label(self.spec, name))
            if problem:
                calls = f" (call {k} of your {name} in this case)" if len(expected) > 1 else ""
                raise WrongForm(problem + calls)


class Wrapped:
    """The answer's functions as a case's call sees them: each call is the answer's code running
    (under the guard, for a student or a bug), its exceptions marked as the answer's, its return
    checked in form."""

    def __init__(self, spec, answer, run):
        self._answer, self._run = answer, run
        for name in spec.FUNCTIONS:
            setattr(self, name, self._wrap(name, answer.functions[name]))

    def _wrap(self, name, fn):
        run, guarded = self._run, self._run.mode == "answer"

        def answer_function(*args, **kwargs):
            if run.depth:   # called from the answer's own code (through a patched module): no second check
                return fn(*args, **kwargs)
            refusals = len(GUARD.refusals)
            run.depth += 1
            try:
                with GUARD.running() if guarded else contextlib.nullcontext():
                    value = fn(*args, **kwargs)
            except Exception as e:
                with contextlib.suppress(Exception):
                    e.raised_by_answer = name
                raise
            finally:
                run.depth -= 1
            if guarded and len(GUARD.refusals) > refusals:   # refused, and the answer caught it
                error = GUARD.refusals[-1]
                error.raised_by_answer = name
                raise error
            run.returned(name, value)
            return value

        answer_function.__name__ = answer_function.__qualname__ = name
        answer_function.__wrapped__ = fn
        return answer_function


def truth(spec, case, truths, i):
    """The reference's output for case i and the forms of its returns: computed once, first,
    on its own copy of the inputs."""
    if i not in truths:
        forms, output = {}, None
        inputs = fresh(case)
        if case.trace:
            run = Run(spec, "truth", forms)
            output = call(case, Wrapped(spec, as_answer(spec, spec.REFERENCE), run), inputs)
        if case.expected:
            try:
                output = case.expected(**(fresh(case) if case.mutable and case.trace else inputs))
            except (NotReady, KeyboardInterrupt):
                raise
            except Exception as e:
                raise CheckerError(e)
        if isinstance(output, Outcome):
            if output.kind != "raised":
                raise CheckerError(RuntimeError(f"the reference's own run failed: {output.problem}"))
            output = output.output
        truths[i] = Truth(output, forms)
    return truths[i]


def call(case, wrapped, inputs):
    """case.call(wrapped, **inputs): its output, or an Outcome for what went wrong and whose it was."""
    try:
        return case.call(wrapped, **inputs)
    except (NotReady, KeyboardInterrupt):
        raise
    except (WrongForm, Wrong) as e:
        return Outcome(problem=str(e), kind="form")
    except Exception as e:
        if isinstance(e, NotImplementedError) and getattr(e, "raised_by_answer", None) and not str(e):
            raise NotStarted(e)
        if getattr(e, "raised_by_answer", None) or isinstance(e, Refused):
            return Outcome(Raised(e), kind="raised")
        raise CheckerError(e)


def run_case(spec, case, answer, truths, i):
    """The answer's Outcome on case i, judged against the truth (computed first)."""
    right = truth(spec, case, truths, i)
    inputs = fresh(case)
    before = {name: fingerprint(value) for name, value in inputs.items()}
    with GUARD.answering(answer, spec.REFERENCE):
        output = call(case, Wrapped(spec, answer, Run(spec, "answer", right.forms)), inputs)
    outcome = output if isinstance(output, Outcome) else Outcome(output)
    if outcome.kind == "value":
        outcome.problem = judge(spec, case, right, outcome.output)
    if outcome.kind == "raised" and not isinstance(outcome.output.error, Refused) and isinstance(right.output, Raised) \
            and type(right.output.error) is type(outcome.output.error):
        outcome.problem = None   # the reference raises the same here
    elif outcome.kind == "raised":
        outcome.problem = repr(outcome.output) if isinstance(outcome.output.error, Refused) else \
            f"your code {outcome.output!r}"
    changed = changes(before, inputs, case, right)
    if changed and not outcome.problem:
        outcome.problem, outcome.kind = changed, "changed"
    elif changed:
        outcome.problem += f"\n  and: {changed}"
    return outcome


def judge(spec, case, right, out):
    """None if out is right for the case, else what is wrong, in words: its form first, then values."""
    name, items = output_label(spec, case, right)
    if case.holds:
        if right.output is not None and not isinstance(right.output, Raised):
            problem = form_difference(out, right.output, name, items)
            if problem:
                return problem
        return case.holds(out)
    return difference(out, right.output, case.atol, name, items)


def behaves_like(spec, bug, cases, truths, i, outcome):
    """Does the bug pass every case before i, as the answer did, and fail case i the same way?"""
    answer = as_answer(spec, bug)
    if answer.problem or not answer.started:
        return False
    for j in range(i + 1):
        if not device_available(cases[j].device):
            continue
        try:
            theirs = run_case(spec, cases[j], answer, truths, j)
        except (NotStarted, NotReady, CheckerError):
            return False
        if j < i and theirs.problem:
            return False
    if not theirs.problem or theirs.kind != outcome.kind:
        return False
    if outcome.kind == "value" and not cases[i].holds:
        return difference(theirs.output, outcome.output, cases[i].atol) is None
    if outcome.kind == "raised":
        return type(theirs.output.error) is type(outcome.output.error)
    return outcome.kind == "value" or theirs.problem == outcome.problem   # a property both break; the same form


# -----------------------------------------------------------------------------
# Inputs: fresh copies, moved to the case's device, and checked untouched

def fresh(case):
    """A deep copy of case.inputs(), on the case's device and dtype. Weak references inside it (a
    KVCache's model) point to the copies."""
    try:
        with torch.device(case.device) if case.device else contextlib.nullcontext():
            inputs = case.inputs()   # tensors made here are made on the case's device (meta: no memory)
    except (NotReady, KeyboardInterrupt):
        raise
    except Exception as e:
        raise CheckerError(e)
    memo = {}
    inputs = copy.deepcopy(inputs, memo)
    for new in list(memo.values()):
        attributes = getattr(new, "__dict__", None)
        if isinstance(attributes, dict):
            for key, value in list(attributes.items()):
                if isinstance(value, weakref.ref) and value() is not None and id(value()) in memo:
                    attributes[key] = weakref.ref(memo[id(value())])
    if case.device or case.dtype:
        inputs = {name: place(value, case.device, case.dtype) for name, value in inputs.items()}
    return inputs


def place(value, device, dtype):
    if isinstance(value, (torch.Tensor, nn.Module)):
        if device:
            value = value.to(device)
        if dtype and (isinstance(value, nn.Module) or value.is_floating_point()):
            value = value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(place(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: place(v, device, dtype) for k, v in value.items()}
    return value


def fingerprint(value, seen=None):
    """What must come back unchanged, as comparable parts keyed by their path (".blocks.0.attn.alpha",
    "[2]"): tensors cloned; a module's weights, modes, settings and hooks; a dataclass's fields; an
    object's attributes."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().clone() if value.device.type != "meta" else value.detach(),
                value.requires_grad)
    if isinstance(value, (int, float, str, bool, type(None), Path, torch.dtype, torch.device)):
        return ("plain", value)
    if id(value) in seen:
        return ("seen",)
    seen.add(id(value))
    if isinstance(value, nn.Module):
        parts = {f".{k}": fingerprint(v, seen) for k, v in value.state_dict(keep_vars=True).items()}  # requires_grad too
        for name, module in value.named_modules():
            prefix = f".{name}" if name else ""
            for key, attr in vars(module).items():
                if key.startswith("_"):
                    if key.endswith("hooks") and isinstance(attr, dict):
                        parts[f"{prefix}.{key}"] = ("plain", f"{len(attr)} hook(s)")
                    continue
                parts[f"{prefix}.{key}"] = fingerprint(attr, seen)
        return ("parts", parts)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("parts", {f".{f.name}": fingerprint(getattr(value, f.name), seen) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return ("parts", {f"[{k!r}]": fingerprint(v, seen) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return ("parts", {f"[{k}]": fingerprint(v, seen) for k, v in enumerate(value)})
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, (type, ModuleType)) and not callable(value):
        return ("parts", {f".{k}": fingerprint(v, seen) for k, v in attributes.items() if not isinstance(v, weakref.ref)})
    return ("other",)


def changes(before, inputs, case, right):
    """What the answer changed among its inputs, in words, or None."""
    for name, old in before.items():
        if name in case.mutable:
            continue
        found = changed(old, fingerprint(inputs[name]))
        if found:
            who = f"your {next(iter(right.forms))}" if len(right.forms) == 1 else "your code"
            path, detail = found
            if not path and old[0] == "tensor":
                return f"{who} changed its input `{name}` in place ({detail})"
            return f"{who} changed its input `{name}`: `{name}{path}` {detail}"
    return None


def changed(old, new, path=""):
    """(where, what) for the first difference between two fingerprints, or None."""
    if old[0] != new[0]:
        return path, "was replaced by something else"
    if old[0] == "tensor":
        a, b = old[1], new[1]
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return path, f"was a tensor of shape {tuple(a.shape)} ({a.dtype}), now {tuple(b.shape)} ({b.dtype})"
        if old[2] != new[2]:
            return path, f"changed its requires_grad from {old[2]} to {new[2]}"
        if a.device.type != "meta":
            same = (a == b) | (a != a) & (b != b) if a.is_floating_point() or a.is_complex() else a == b
            if not bool(same.all()):
                return path, f"{int((~same).sum())} of {a.numel()} entries differ"
        return None
    if old[0] == "plain":
        same = old[1] == new[1] or (old[1] != old[1] and new[1] != new[1])
        return None if same else (path, f"was {short(old[1], 60)}, now {short(new[1], 60)}")
    if old[0] == "parts":
        for key, part in old[1].items():
            if key not in new[1]:
                return path + key, "is gone"
            found = changed(part, new[1][key], path + key)
            if found:
                if found[0] == path + key and part[0] == "tensor" and "entries differ" in found[1]:
                    return found[0], f"changed in place ({found[1]})"
                return found
        extra = [key for key in new[1] if key not in old[1]]
        return (path + extra[0], "is new: it was not there before") if extra else None
    return None


# -----------------------------------------------------------------------------
# Forms and differences, in words

@dataclass(frozen=True)
class TensorForm:
    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class TypeForm:
    type: type


def form_of(value):
    """The form of a value: tensors by (shape, dtype, device); tuples, lists of tensors and dicts by
    their structure; everything else by its type."""
    if isinstance(value, (TensorForm, TypeForm, Raised)):
        return value
    if isinstance(value, torch.Tensor):
        return TensorForm(tuple(value.shape), value.dtype, value.device)
    if isinstance(value, tuple) or isinstance(value, list) and not all(is_scalar(v) for v in value):
        return type(value)(form_of(v) for v in value)
    if isinstance(value, dict):
        return {k: form_of(v) for k, v in value.items()}
    return TypeForm(type(value))


def is_scalar(value):
    return isinstance(value, (bool, int, float, str, type(None)))


def return_label(spec, name):
    """(label, item labels) for what the answer's function `name` returns, from spec.RETURNS."""
    names = getattr(spec, "RETURNS", {}).get(name)
    if isinstance(names, str):
        return f"your {names}", None
    return f"what your {name} returned", names


def output_label(spec, case, right):
    if case.output:
        return case.output, None
    if len(right.forms) == 1 and sum(len(f) for f in right.forms.values()) == 1:
        return return_label(spec, next(iter(right.forms)))
    return "your output", None


def verb(label, singular):
    last = label.split()[-1]
    plural = last.endswith("s") and not last.endswith(("ss", "is", "us"))
    return {"has": "have", "is": "are"}[singular] if plural else singular


def describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    if is_scalar(value):
        return f"{article(type(value).__name__)} ({short(value, 60)})"
    return article(type(value).__name__)


def article(name):
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


def describe_form(form):
    if isinstance(form, TensorForm):
        return f"a tensor of shape {form.shape} ({form.dtype})"
    if isinstance(form, (tuple, list)):
        return f"a {type(form).__name__} of {len(form)} items"
    if isinstance(form, dict):
        return f"a dict with the keys {sorted(form)}"
    return article(form.type.__name__)


def form_difference(out, form, label="your output", items=None):
    """None when out has the form (type, shape, dtype, device; a container's structure), else
    what differs, in words. Never touches out's values. items: names for a tuple's items."""
    form = form_of(form)
    if isinstance(form, Raised):
        return None
    if isinstance(form, TensorForm):
        if not isinstance(out, torch.Tensor):
            return f"{label} {verb(label, 'is')} {describe(out)}, expected {describe_form(form)}"
        if tuple(out.shape) != form.shape:
            return f"{label} {verb(label, 'has')} shape {tuple(out.shape)}, expected {form.shape}"
        if out.dtype != form.dtype:
            return f"{label} {verb(label, 'has')} dtype {out.dtype}, expected {form.dtype}"
        if out.device.type != form.device.type:
            return f"{label} {verb(label, 'is')} on {out.device.type}, expected {form.device.type}"
        return None
    if isinstance(form, (tuple, list)):
        if not isinstance(out, (tuple, list)):
            return f"{label} {verb(label, 'is')} {describe(out)}, expected {describe_form(form)}"
        if len(out) != len(form):
            return f"{label} {verb(label, 'has')} {len(out)} items, expected {len(form)}"
        for k, (o, f) in enumerate(zip(out, form)):
            item = f"your {items[k]}" if items and k < len(items) else f"item {k} of {label}"
            problem = form_difference(o, f, item)
            if problem:
                return problem
        return None
    if isinstance(form, dict):
        if not isinstance(out, dict):
            return f"{label} {verb(label, 'is')} {describe(out)}, expected {describe_form(form)}"
        if set(out) != set(form):
            return f"{label} {verb(label, 'has')} the keys {sorted(map(str, out))}, expected {sorted(map(str, form))}"
        for key in form:
            problem = form_difference(out[key], form[key], f"{label}[{key!r}]")
            if problem:
                return problem
        return None
    expected = form.type
    if expected is float and type(out) is int:   # an int where a float is expected is a number all the same
        return None
    if expected is type(None) or is_scalar_type(expected):
        if type(out) is not expected:
            return f"{label} {verb(label, 'is')} {describe(out)}, expected {article(expected.__name__)}"
        return None
    if not isinstance(out, expected):
        return f"{label} {verb(label, 'is')} {describe(out)}, expected {article(expected.__name__)}"
    return None


def is_scalar_type(t):
    return t in (bool, int, float, str)


def difference(out, ref, atol=0.0, label="your output", items=None):
    """None when out equals ref (to atol), else what differs, in words: the form first (type, shape,
    dtype, device), then the largest difference of the values."""
    if isinstance(ref, Raised):
        return None if isinstance(out, Raised) and type(out.error) is type(ref.error) else \
            f"the reference raises ({ref.error}) here, yours returned {short(out)}"
    return form_difference(out, ref, label, items) or value_difference(out, ref, atol)


def value_difference(out, ref, atol=0.0):
    if isinstance(ref, torch.Tensor):
        return tensor_difference(out, ref, atol)
    if isinstance(ref, dict):
        for key in ref:
            problem = value_difference(out[key], ref[key], atol)
            if problem:
                return f"at [{key!r}]: {problem}"
        return None
    if isinstance(ref, (list, tuple)):
        if len(out) != len(ref):
            return f"yours is {short(out)}, the reference {short(ref)}"
        for k, (o, r) in enumerate(zip(out, ref)):
            problem = value_difference(o, r, atol)
            if problem:
                return f"at item {k}: {problem}"
        return None
    if isinstance(ref, float):
        if not math.isclose(out, ref, rel_tol=0, abs_tol=atol):
            return f"yours {short(out)}, the reference {short(ref)}"
        return None
    if is_scalar(ref) and out != ref:
        return f"yours {short(out)}, the reference {short(ref)}"
    return None


def tensor_difference(out, ref, atol):
    if ref.device.type == "meta" or out.device.type == "meta":
        return None   # no values on the meta device: the form is all there is
    out, ref = out.detach().cpu(), ref.detach().cpu()
    if ref.dtype == torch.bool or not ref.is_floating_point():
        wrong = (out != ref).nonzero()
        if len(wrong) == 0:
            return None
        first = tuple(wrong[0].tolist())
        return (f"{len(wrong)} of {ref.numel()} entries differ; the first at index {first}: "
                f"yours {out[first].item()}, the reference {ref[first].item()}")
    if not torch.isfinite(out).all() and torch.isfinite(ref).all():
        return f"yours has {(~torch.isfinite(out)).sum().item()} NaN or inf entries"
    err = (out.double() - ref.double()).abs().nan_to_num(nan=math.inf)
    err[(out != out) & (ref != ref)] = 0   # NaN where the reference has NaN is right
    worst = err.max().item() if err.numel() else 0.0
    if worst <= atol:
        return None
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return (f"largest difference {worst:.3g} at index {where}: yours {out[where].item():.6g}, "
            f"the reference {ref[where].item():.6g}; allowed {atol:g}")


def short(x, limit=160):
    text = f"tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) and x.numel() > 8 else \
        repr(x.tolist() if isinstance(x, torch.Tensor) else x)
    return text if len(text) <= limit else text[:limit] + " ..."


def grid(mask):
    """A small boolean matrix as rows of '#' (True) and '.' (False)."""
    return ["".join("#" if v else "." for v in row) for row in mask.tolist()]


# -----------------------------------------------------------------------------
# Reports

def not_started(path, error=None):
    where = relpath(path) if path else "your file"
    name = ""
    if error is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        name, where = f"`{frame.name}` in ", relpath(frame.filename)
    if path and Path(path).resolve().parent == STUBS.resolve():
        n = ORDER.index(Path(path).stem) + 1 if Path(path).stem in ORDER else "N"
        return (f"not started: {name}{where} still raises NotImplementedError. Start it with "
                f"`python -m exercises start {n}` (it copies the stub to "
                f"{relpath(MINE / Path(path).name)}), then open that file, read its docstring, and write it.")
    return f"not started: {name}{where} still raises NotImplementedError. Open the file, read its docstring, and write it."


def relpath(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except (ValueError, OSError):
        return str(path)


def failure(case, outcome, right, named):
    out, ref = outcome.output, right.output
    lines = ["FAIL. The smallest failing case:", f"  {case.what}", f"  what is wrong: {outcome.problem}"]
    if outcome.kind == "value" and isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) \
            and ref.dtype == torch.bool and out.dtype == torch.bool and out.shape == ref.shape and ref.dim() == 2 \
            and max(ref.shape) <= 24 and ref.device.type != "meta" and out.device.type != "meta":
        lines += ["  yours" + " " * (ref.size(1) + 2) + "the reference   (rows: queries, columns: keys; # = attends)"]
        lines += [f"  {a}  {' ' * 5}{b}" for a, b in zip(grid(out), grid(ref))]
    lines.append(f"  the invariant it breaks: {case.invariant}")
    for bug in named:
        lines.append(f"  This behaves like a known mistake: {bug.name}. {bug.why}")
    return "\n".join(lines)


def checker_failure(case, error):
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(STUBS.resolve())]
    frames = ours or frames
    where = f" (at {relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    return ("ERROR. The checker's own code failed on this case, not your code:\n"
            f"  {case.what}\n  {type(error).__name__}: {error}{where}\n"
            "  This is a bug in the checker: please show this message to your teacher.")


# -----------------------------------------------------------------------------
# Helpers the checks share: tiny float64 models, patching

def tiny_model(attn="orthros", seed=0, randomize=True, **overrides):
    """A tiny float64 model in eval mode. randomize=True moves the scale-offsets (and the optional
    convolution) off their identity start, so that the two streams' queries differ."""
    kw = dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=4, attn=attn, max_seq_len=512)
    torch.manual_seed(seed)
    model = orthros.Orthros(orthros.OrthrosConfig(**{**kw, **overrides})).double().eval()
    if randomize:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.split(".")[-1] in orthros.SCALE_OFFSETS or name.endswith("conv.weight"):
                    p.add_(0.5 * torch.randn_like(p))
    return model


def tokens(B, T, vocab=37, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def using(what):
    """Around checker code that uses what the answer returned (runs the model it built, hands its t_out
    to orthros.py): what that raises is a failure of the answer, "what raised ...", not the checker's."""
    try:
        yield
    except (NotReady, WrongForm, Wrong):
        raise
    except Exception as e:
        if getattr(e, "raised_by_answer", None):
            raise
        raise Wrong(f"{what} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


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


def variant(reference, **changed):
    """The reference's functions with some replaced: a known-bug version."""
    return SimpleNamespace(**{**vars(reference), **changed})
