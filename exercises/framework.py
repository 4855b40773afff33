"""The checker every exercise shares: one contract. On inputs drawn from each function's Domain,
smallest first, the answer and the reference agree on
  inputs    every argument as the reference leaves it;
  values    the output's form (type; shape, dtype, device; length, keys, attributes), then values;
  autograd  requires_grad of each output tensor; the gradients of the floating inputs and weights;
  repeats   a call after the caller changed the first output, and after the inputs changed in place.
Then PROPERTIES, then after_pass. The reference and FORBIDDEN raise while the answer runs."""

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
import os
import random
import shutil
import sys
import time
import traceback
import types
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn as nn

import orthros


def numbered(folder):
    """{number: name} of the checkers in folder; two of one number are an error."""
    paths = sorted(folder.glob("ex[0-9][0-9]_*.py"))
    for a, b in zip(paths, paths[1:]):
        if a.name[:4] == b.name[:4]:
            raise ImportError(f"{folder} holds two checkers numbered {int(a.name[2:4])}, "
                              f"{a.name} and {b.name}: renumber one")
    return {int(path.name[2:4]): path.stem for path in paths}


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STUBS, SOLUTIONS, MINE, CHECKS = HERE / "stubs", HERE / "solutions", HERE / "mine", HERE / "checks"
EXERCISES = numbered(CHECKS)   # number -> name
TOLERANCE = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-4),
             torch.bfloat16: (3e-2, 3e-2)}   # (atol, rtol)
POOL, REPEATS = 300, 2   # random draws the inputs are picked from; inputs called again, a function


class Domain:
    """Each parameter's values: a list (a value listed twice is drawn twice as often) or a function
    of the ones before; the inputs hold every value, every two of `pairs` (True: all) and `draws`
    random ones. build(seed, **params) -> the other arguments; dtype, place, default: read here."""

    def __init__(self, build=None, pairs=(), draws=10, **params):
        self.build, self.pairs, self.draws, self.params = build, pairs, draws, params


# status: PASS, FAIL, not started, waiting (the recall lab's runs), ERROR (the checker's own)
Result = collections.namedtuple("Result", "status message seconds", defaults=("", 0.0))
Answer = collections.namedtuple("Answer", "functions path problem started trusted",
                                defaults=(None, None, True, False))
Run = collections.namedtuple("Run", "out before after grads")   # a call, its inputs before, after


# The answer fails (args[0] says how); what the check needs is not there yet (the recall lab's
# runs); the answer called what its exercise refuses; it still raises the stub's NotImplementedError
Fail, NotReady, Refused, NotStarted = (type(name, (Exception,), {})
                                       for name in ("Fail", "NotReady", "Refused", "NotStarted"))


def load_spec(n):
    return importlib.import_module(f"exercises.checks.{EXERCISES[n]}")


def stub_source(spec, folder=None):
    return ((folder or STUBS) / f"{spec.__name__.rsplit('.', 1)[-1]}.py").read_text()


solved_source = functools.partial(stub_source, folder=SOLUTIONS)


def hints(spec):
    """The exercise's hints: in exercises/hints.md, its section "## exNN_name", each "### k"."""
    section = (HERE / "hints.md").read_text().split(f"\n## {spec.__name__.rsplit('.', 1)[-1]}\n")
    return [h.split("\n", 1)[1].strip() for h in section[-1].split("\n## ")[0].split("\n### ")[1:]]


# Answers, and the guard: while the answer's code runs, each refused function's code raises

_loaded, ANSWER_FILES = itertools.count(), set()   # ANSWER_FILES: their frames are the student's
STATE = SimpleNamespace(active=False, why={}, refusals=[])   # refusals: all raised (some caught)


def load_answer(spec, source, filename):
    """A student's file run as a module, guarded; refused if it imports from exercises/."""
    filename, where = str(filename), relpath(filename)
    ANSWER_FILES.add(filename)
    module = types.ModuleType(f"_exercise_answer_{next(_loaded)}")
    module.__file__, sys.modules[module.__name__] = filename, module   # (dataclasses need it)
    try:
        tree = ast.parse(source, filename)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in (name for name in names if name.split(".")[0] == "exercises"):
                return Answer({}, filename, f"{where} does not import: ImportError: line "
                              f"{node.lineno} imports `{name}`, which is not available to your "
                              "code (the stored solutions, the checker): write it yourself.")
        with guarding(spec):
            exec(compile(tree, filename, "exec"), module.__dict__)
    except Exception as e:
        started = not isinstance(e, NotImplementedError) or bool(str(e))
        return Answer({}, filename, f"{where} does not import: {one_line(e)}" if started else None,
                      started=started)
    missing = [f for f in spec.FUNCTIONS if not callable(getattr(module, f, None))]
    if missing:
        return Answer({}, filename, f"{where} has no function `{missing[0]}`: keep the stub's name "
                      "and signature")
    return Answer({f: getattr(module, f) for f in spec.FUNCTIONS}, filename)


def refused_functions(spec):
    """{function: why}: the reference's and FORBIDDEN's ("module:name" once that module is in)."""
    found = {inspect.unwrap(getattr(spec.REFERENCE, f)): "the reference answer of this exercise"
             for f in spec.FUNCTIONS}
    for fn, why in getattr(spec, "FORBIDDEN", {}).items():
        module, _, name = fn.partition(":") if isinstance(fn, str) else (None, None, None)
        if module in sys.modules:
            fn = functools.reduce(getattr, name.split("."), sys.modules[module])
        if module is None or module in sys.modules:
            found[inspect.unwrap(fn)] = why
    return found


def refusing(*args, **kwargs):
    """Each refused function's code while the answer runs (co_filename: the function's name)."""
    here = __import__("exercises.framework", fromlist=["STATE"])
    name = here.sys._getframe().f_code.co_filename
    here.STATE.refusals.append(here.Refused(f"your code called {name} ({here.STATE.why[name]}), "
                                            "which the checker refuses while your code runs"))
    raise here.STATE.refusals[-1]


@contextlib.contextmanager
def guarding(spec):
    """Each refused function's __code__ swapped for refusing's, then restored: captured ones too."""
    if STATE.active:   # the answer calling its own functions
        yield
        return
    saved, STATE.active = {}, True
    try:
        for fn, why in refused_functions(spec).items():
            name = f"{fn.__module__}.{fn.__qualname__}"
            STATE.why[name], saved[fn] = why, fn.__code__
            fn.__code__ = refusing.__code__.replace(co_name=fn.__name__, co_filename=name,
                                                    co_qualname=fn.__qualname__)
        yield
    finally:
        for fn, code in saved.items():
            fn.__code__ = code
        STATE.active = False


def guarded(spec, answer):
    """The answer's functions under the guard: what they raise, or a refusal caught, is theirs."""
    def wrap(fn):
        @functools.wraps(fn)
        def answer_function(*args, **kwargs):
            refusals = len(STATE.refusals)
            with guarding(spec):
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    e.by_answer = not isinstance(e, (Fail, NotReady))
                    raise
            if len(STATE.refusals) > refusals:
                raise STATE.refusals[-1]
            return value
        return answer_function
    return SimpleNamespace(**{name: fn if answer.trusted else wrap(fn)
                              for name, fn in answer.functions.items()})


@contextlib.contextmanager
def crashes(what):
    """What the answer raises fails it as "{what}: ..." (a bare NotImplementedError: not begun)."""
    try:
        yield
    except Exception as e:
        if not (getattr(e, "by_answer", False) or isinstance(e, Refused)):
            raise
        if isinstance(e, NotImplementedError) and not str(e):
            raise NotStarted(e) from e
        if "leaf Variable that requires grad is being used in an in-place" in str(e):
            what = what.replace("(crash)", "(inputs)").replace("crashed", "writes into an input")
        if isinstance(e, Refused):
            what = what.replace("(crash)", "(refused)").replace("crashed", "calls what is refused")
        raise Fail(f"{what}: {e if isinstance(e, Refused) else 'your code raised ' + one_line(e)}"
                   f"{answer_line(e)}") from e


# The contract

RUNS = {}   # the reference's runs, kept for the process: (its function, input, seed) -> Run


def check(spec, impl, summary=True, **options):
    """The contract on every function of spec, then its PROPERTIES and after_pass: one thread."""
    threads, start = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)
    try:
        return run(spec, impl, summary, options)._replace(seconds=time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def run(spec, impl, summary, options):
    answer = impl if isinstance(impl, Answer) else Answer(
        {f: getattr(impl, f) for f in spec.FUNCTIONS}, trusted=impl is spec.REFERENCE)
    if answer.problem or not answer.started:
        return Result("FAIL", f"FAIL. {answer.problem}") if answer.started else \
            Result("not started", not_started(answer.path))
    functions = guarded(spec, answer)
    try:
        for name in spec.FUNCTIONS:
            contract(spec, name, getattr(functions, name))
        for prop in getattr(spec, "PROPERTIES", ()):   # each docstring's first line names it
            with crashes(f"({prop.__doc__.splitlines()[0]})"):
                judge(prop.__doc__.splitlines()[0], "", prop(functions, **options))
        with crashes("(the summary of your answer)"):
            told = summary and hasattr(spec, "after_pass") and spec.after_pass(functions, **options)
            return Result("PASS", told or "")
    except Fail as e:
        return Result("FAIL", f"FAIL {e}")
    except NotStarted as e:
        return Result("not started", not_started(answer.path, e.args[0]))
    except NotReady as e:
        return Result("waiting", str(e))
    except Exception as e:   # the checker's own code (a KeyboardInterrupt stops the check)
        return Result("ERROR", f"ERROR. The checker's own code failed, not your code: {one_line(e)}"
                      f"{answer_line(e, lambda f: f.startswith(str(HERE)))}\n  This is a bug in "
                      "the checker: please show this message to your teacher.")


def contract(spec, name, fn):
    """On each input, smallest first, the answer agrees with the reference on every property."""
    drawn = draws(spec.DOMAIN[name])
    values = [i for i, params in enumerate(drawn) if "meta" not in params.values()]   # (meta: none)
    again = {values[len(values) * (k + 1) // (REPEATS + 1)] for k in range(REPEATS * bool(values))}
    for i, params in enumerate(drawn):
        inputs = make(spec, name, params)
        at = f"your {name} {{}} at {call_text(name, inputs, params)}:\n  "
        ref = reference(spec, name, params)
        with crashes(f"(crash): {at.format('crashed')[:-4]}"):
            mine = observe(fn, inputs, params)
        judge("inputs", at.format("changes its inputs"), changes(mine, ref))
        judge("values", at.format("differs from the reference"), difference(mine.out, ref.out))
        judge("autograd", at.format("differs from the reference"), autograd(mine, ref))
        if i in again:
            repeat(spec, name, fn, params, inputs, mine, at)


def judge(prop, at, problem):
    if problem:
        raise Fail(f"({prop}): {at}{problem}")


def reference(spec, name, params, seed=0):
    key = (getattr(spec.REFERENCE, name), repr(params), seed)
    if key not in RUNS:
        RUNS[key] = observe(getattr(spec.REFERENCE, name), make(spec, name, params, seed), params)
    return RUNS[key]


def observe(fn, inputs, params):
    """fn's output, inputs before and after, gradients (float64, inputs <= 1e3: no saturation)."""
    try:
        before = snapshot(inputs)
        torch.manual_seed(0)   # dropout: the same masks for the reference and the answer
        with torch.device(params["default"]) if "default" in params else contextlib.nullcontext():
            out = fn(**inputs)
        outs, grads = [t for t in tensors(out) if t.requires_grad], None
        if outs and all(t.dtype == torch.float64 and not t.is_meta for t in outs) and all(
                x.numel() == 0 or x.abs().max() <= 1e3 for x in tensors(list(inputs.values()))):
            wrt = {f"`{k}`": x for k, x in inputs.items() if getattr(x, "requires_grad", False)}
            wrt.update({f"`{k}.{n}`": p for k, m in inputs.items() if isinstance(m, nn.Module)
                        for n, p in m.named_parameters() if p.requires_grad})
            g = torch.Generator().manual_seed(1)
            dy = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in outs]
            found = torch.autograd.grad(outs, list(wrt.values()), dy, allow_unused=True)
            grads = {k: torch.zeros_like(x) if d is None else d
                     for (k, x), d in zip(wrt.items(), found)}
        return Run(out, before, snapshot(inputs), grads)
    except Exception as e:
        e.by_answer = getattr(e, "by_answer", True)
        raise


def autograd(mine, ref):
    flags = lambda out: [t.requires_grad for t in tensors(out)]
    if flags(mine.out) != flags(ref.out):
        ask = "no step runs under torch.no_grad() or .detach()" if any(flags(ref.out)) else \
            "it runs under torch.no_grad()"
        return (f"requires_grad of your output's tensors is {flags(mine.out)}, the reference's "
                f"{flags(ref.out)}: check that {ask}, as the reference's does")
    for k, right in (ref.grads or {}).items():   # to 1e-9 of its largest entry
        atol = 1e-9 * max(1.0, right.abs().max().item() if right.numel() else 0.0)
        problem = tensor_difference(mine.grads[k], right, atol)
        if problem:
            return (f"the gradient of {k} (of a random weighted sum of the output) differs: "
                    f"{problem}: does a step leave autograd?")


def changes(mine, ref):
    """Where the answer leaves its inputs otherwise than the reference, in words, or None."""
    for path in dict.fromkeys([*ref.after, *mine.after]):
        kept = not difference(ref.after.get(path, GONE), ref.before.get(path, GONE))
        right = (mine.before if kept else ref.after).get(path, GONE)
        now = mine.after.get(path, GONE)
        if GONE in (right, now) and right is not now:
            return f"`{path}` is {'new' if right is GONE else 'gone'}"
        problem = difference(now, right, "yours")
        if problem:
            how = "changed" if kept else "is not as the reference leaves it"
            return f"`{path}` {how}: {problem}"


def repeat(spec, name, fn, params, inputs, mine, at):
    """Called again after the caller changed the first output, then after the inputs changed."""
    with torch.no_grad():
        spoil(mine.out)
    shared = changes(Run(0, mine.after, snapshot(inputs), 0), Run(0, mine.after, mine.after, 0))
    judge("inputs", at.format("shares memory with its inputs: changing its output changes them"),
          shared)
    inputs = make(spec, name, params)
    with crashes(f"(repeats): {at.format('crashed when called again')[:-4]}"):
        judge("repeats", at.format("differs when called again (after the caller changed its first "
                                   "output in place)"),
              difference(observe(fn, inputs, params).out, reference(spec, name, params).out))
        with torch.no_grad():
            assign(inputs, make(spec, name, params, seed=1))
        judge("repeats", at.format("differs when called again after its inputs changed in place "
                                   "(new values in the same tensors, modules, files)"),
              difference(observe(fn, inputs, params).out, reference(spec, name, params, 1).out))


def draws(domain, seed=0):
    """Greedily the POOL draws holding values (and pairs) not held yet, then `draws` random ones."""
    rng, names = random.Random(seed), list(domain.params)
    pairs = list(itertools.combinations(names, 2)) if domain.pairs is True else domain.pairs

    def draw():
        params, at = {}, {}
        for name, values in domain.params.items():
            if callable(values):
                values = values(**{k: params[k] for k in inspect.signature(values).parameters})
            at[name] = rng.randrange(len(values))
            params[name] = values[at[name]]
        held = [(n, at[n]) for n in names] + [(a, at[a], b, at[b]) for a, b in pairs]
        return params, frozenset(held)

    pool, chosen, held = [draw() for _ in range(POOL)], [], set()
    while (best := max(pool, key=lambda d: len(d[1] - held)))[1] - held:
        chosen.append(best[0])
        held |= best[1]
    numbers = lambda p: [x for v in p.values() for x in (v if isinstance(v, tuple) else (v,))
                         if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return sorted({repr(p): p for p in chosen + [p for p, _ in pool[:domain.draws]]}.values(),
                  key=lambda p: ("meta" in p.values(), sum(map(abs, numbers(p)))))


def make(spec, name, params, seed=0):
    """The call's arguments for params (strings made at run time: `is` a literal is False)."""
    domain, names = spec.DOMAIN[name], inspect.signature(getattr(spec.REFERENCE, name)).parameters
    inputs = {**params, **(domain.build(seed=seed, **params) if domain.build else {})}
    return {k: fresh(inputs[k], params) for k in names if k in inputs}


def fresh(x, params):
    if isinstance(x, str):
        return "".join(list(x))
    if isinstance(x, (torch.Tensor, nn.Module)):
        x = x.to(params["place"]) if "place" in params else x
        if params.get("dtype") and (isinstance(x, nn.Module) or x.is_floating_point()):
            x = x.to(params["dtype"])
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.is_meta:
            x = x.detach().requires_grad_()
    for config in [x, getattr(x, "config", None)]:
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            for field in (f.name for f in dataclasses.fields(config)):
                if isinstance(getattr(config, field), str):
                    setattr(config, field, fresh(getattr(config, field), params))
    return x


def tensors(out):
    parts = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [out] if isinstance(out, torch.Tensor) else [t for part in parts for t in tensors(part)]


def spoil(out):
    """Change out in place, as a caller may: its tensors, a module's weights, a list, a dict."""
    for t in tensors(out) + (list(out.parameters()) if isinstance(out, nn.Module) else []):
        if not t.is_meta:
            t.data.logical_not_() if t.dtype == torch.bool else t.data.add_(1)
    if isinstance(out, (list, dict)):
        out.append(None) if isinstance(out, list) else out.setdefault(object(), None)


def assign(old, new):
    """new's contents put into old, in place where old can change; what old's holder holds now."""
    if isinstance(old, torch.Tensor):
        old.data = new.data
    elif isinstance(old, nn.Module):
        old.load_state_dict(new.state_dict())
    elif isinstance(old, (list, dict)):
        for k in range(len(old)) if isinstance(old, list) else list(old):
            old[k] = assign(old[k], new[k])
    elif isinstance(old, (str, os.PathLike)) and os.path.isabs(old) and os.path.isdir(old):
        shutil.rmtree(old)
        shutil.copytree(new, old)
    elif is_object(old) and type(old) is type(new):
        for k, v in vars(new).items():   # (a weak reference, to its model, stays)
            if not isinstance(v, weakref.ref):
                setattr(old, k, assign(getattr(old, k, None), v))
    else:
        return new
    return old


# Forms and values: each value flattened to {path: what is there}

GONE = object()   # what is at a path that is not there


def flat(x, path=""):
    """x as {path: value}: a tensor's copy and requires_grad, a value, a container's parts."""
    if isinstance(x, torch.Tensor):
        return {path: x.detach() if x.is_meta else x.detach().clone(),
                f"{path}.requires_grad": x.requires_grad}
    if isinstance(x, nn.Module):
        found = {f".{k}": v for k, v in x.state_dict(keep_vars=True).items()}
        for name, module in x.named_modules():
            prefix, hooks = f".{name}" if name else "", vars(module).items()
            found.update({f"{prefix}.{k}": v for k, v in hooks if not k.startswith("_")})
            found[f"{prefix}.hooks"] = sum(len(v) for k, v in hooks if isinstance(v, dict) and
                                           k.endswith("hooks"))
    elif isinstance(x, (dict, list, tuple)):
        found = {f"[{k!r}]": v for k, v in (x.items() if isinstance(x, dict) else enumerate(x))}
    elif is_object(x) and not isinstance(x, weakref.ref):
        found = {f".{k}": v for k, v in vars(x).items() if not k.startswith("_")}
    else:
        return {path: type(x) if isinstance(x, weakref.ref) else x}
    kept = {path: type(x)}
    for key, part in found.items():
        kept.update(flat(part, path + key))
    return kept


def snapshot(inputs):
    return {path: v for name, x in inputs.items() for path, v in flat(x, name).items()}


def is_object(x):
    """Compared by its public attributes (a module, KVCache, config): no tensor, path, function."""
    return isinstance(x, nn.Module) or hasattr(x, "__dict__") and not callable(x) and \
        not isinstance(x, (torch.Tensor, os.PathLike))


def difference(out, ref, label="your output"):
    """What differs between out and ref, in words, or None: the form, then values (to TOLERANCE)."""
    if is_object(ref) and type(out) is type(ref):
        out, ref = flat(out), flat(ref)
    if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor):
        for what, mine, theirs in (("shape", tuple(out.shape), tuple(ref.shape)),
                                   ("dtype", out.dtype, ref.dtype),
                                   ("device", out.device.type, ref.device.type)):
            if mine != theirs:
                return f"{label} has {what} {mine}, expected {theirs}"
        return tensor_difference(out, ref)
    container = isinstance(ref, (tuple, list, dict))
    other = type(out) is not type(ref) and not (type(ref) is float and type(out) is int)
    keys = not other and isinstance(ref, dict) and set(out) != set(ref)
    if other or keys or container and len(out) != len(ref):
        kind = lambda x: type(x).__name__ + f" of {len(x)}" * isinstance(x, (tuple, list, dict))
        return (f"{label} is a {kind(out)}, expected a {kind(ref)}: yours {short(out)}, the "
                f"reference {short(ref)}")
    if container:
        for k in ref if isinstance(ref, dict) else range(len(ref)):
            problem = difference(out[k], ref[k], "yours")
            if problem:
                return f"{label} at {[k] if isinstance(ref, dict) else f'item {k}'}: {problem}"
        return None
    if out == ref or out != out and ref != ref or isinstance(ref, float) and math.isclose(
            out, ref, abs_tol=1e-12):
        return None
    return f"{label} {short(out)}, the reference {short(ref)}"


def tensor_difference(out, ref, atol=None):
    """How out's values differ from ref's (to TOLERANCE; none on meta), in words, or None."""
    if out.is_meta or ref.is_meta or torch.equal(out, ref):
        return None
    tol, rtol = TOLERANCE.get(ref.dtype, (0.0, 0.0))
    out, ref, atol = out.detach(), ref.detach(), tol if atol is None else atol
    bad = ~torch.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    gap = torch.where(bad, (out.double() - ref.double()).abs().nan_to_num(nan=math.inf), -1.0)
    at = tuple(int(i) for i in torch.nonzero(gap == gap.max())[0])   # the largest difference
    allowed, value = f"; allowed {atol:g} + {rtol:g} x |reference|", lambda x: f"{x[at].item():.6g}"
    if not ref.is_floating_point():
        allowed, value = "", lambda x: repr(x[at].item())
    return (f"{int(bad.sum())} of {bad.numel()} entries differ, the most at index {at}: yours "
            f"{value(out)}, the reference {value(ref)}{allowed}")


def short(x, limit=160):
    big = isinstance(x, torch.Tensor) and (x.numel() > 12 or x.is_meta)
    text = f"a tensor of shape {tuple(x.shape)}" if big else repr(
        x.tolist() if isinstance(x, torch.Tensor) else x)
    return text if len(text) <= limit else text[:limit] + " ..."


def call_text(name, inputs, params):
    """The call in words: its arguments (a small integer tensor's values), the other parameters."""
    more = [f"{k}={show(v)}" for k, v in params.items() if k not in inputs]
    args = [f"{k}={show(params[k] if k in params and is_object(v) else v)}"
            for k, v in inputs.items()]
    return f"{name}({', '.join(args)})" + (f", drawn with {', '.join(more)}" if more else "")


def show(x):
    if isinstance(x, torch.Tensor) and (x.numel() > 12 or x.is_meta or x.is_floating_point()):
        where = " on meta" * x.is_meta
        return f"<{'x'.join(map(str, x.shape)) or '0-d'} {str(x.dtype)[6:]} tensor{where}>"
    if isinstance(x, torch.Tensor):
        return f"torch.tensor({x.tolist()}{f', dtype={x.dtype}' * (x.dtype != torch.int64)})"
    return f"<{type(x).__name__}>" if is_object(x) else str(x) if type(x) is torch.dtype else \
        repr(x)


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
    how = f"Start it with `python -m exercises start {int(Path(path).name[2:4])}` (it copies the " \
        "stub to exercises/mine/), then open" if Path(path).resolve().parent == STUBS else "Open"
    how += " the file, read its docstring, and write it."
    what = f"`{frame.name}` in {relpath(frame.filename)}" if frame else relpath(path)
    return f"not started: {what} still raises NotImplementedError. {how}"


# What the checks share: tiny models drawn in float64, inputs, a model with the answer patched in

def tiny_model(attn="orthros", seed=0, **overrides):
    """A tiny float64 model in eval mode, vectors and conv moved; up to 64 channels, W_Q, W_K, W_O
    at 16 times GPT-2's init: attention sharp enough that positions move the logits."""
    config = orthros.OrthrosConfig(**{**dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16,
                                             window=4, attn=attn, max_seq_len=512), **overrides})
    default = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)
    try:
        model = orthros.Orthros(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("conv.weight"):
                    p.add_(0.5 * torch.randn_like(p))
                elif name.endswith(("c_q.weight", "c_k.weight", "attn.c_proj.weight")):
                    p.mul_(16 if config.n_embd <= 64 else 1)
    finally:
        torch.set_default_dtype(default)
    return model


# The zoo: tiny_model's overrides for each option of orthros.py. Every checker that takes a model
# draws from it, so a new option reaches every exercise as one more member here.
ZOO = {"the original": {},
       "Llama-like: untied head, n_head=4 with n_kv_head=2 (GQA), SwiGLU, Q/K/V biases, norm_eps="
       "1e-5, rope_base=5e5, llama3 RoPE scaling": dict(
           tie_embeddings=False, n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=40, qkv_bias=True,
           norm_eps=1e-5, rope_base=500000.0, rope_scaling=dict(
               rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)),
       "scale_offset=False (the paper's w/o SO)": dict(scale_offset=False),
       "dropout=0.1, in eval mode": dict(dropout=0.1), "conv_kernel=3": dict(conv_kernel=3),
       "3 layers, n_head=4, C=24, w=3, rope_base=500, vocab_size=50, seed 1": dict(
           n_layer=3, n_head=4, n_embd=24, window=3, rope_base=500.0, vocab_size=50, seed=1)}


def member(name, attn="orthros", seed=0, **more):
    """A copy of the zoo's member as a tiny model, more overrides on top (made once a process)."""
    return copy.deepcopy(made(name, attn, seed, **more))


@functools.cache
def made(name, attn, seed, **more):
    overrides = {**ZOO[name], **more}
    return tiny_model(attn, seed=overrides.pop("seed", 0) + seed, **overrides)


def within(lo, hi, *values):
    """The values from lo to hi, sorted, once each: a parameter's edges, relative to others'."""
    return sorted({v for v in values if lo <= v <= hi})


def tokens(B, T, vocab=37, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def whole_models(*models):
    """A property: (attn, swa_impl, T, w, t_out) models with the answer patched into orthros.py."""
    def whole_models(answer, **options):
        """whole models with yours patched into orthros.py"""
        for attn, swa_impl, T, w, t_out in models:
            model, idx = tiny_model(attn, window=w, swa_impl=swa_impl), tokens(2, T)
            with torch.no_grad():
                right = model(idx, t_out=t_out)[0]
                with mock.patch.multiple(orthros, **vars(answer)):
                    problem = difference(model(idx, t_out=t_out)[0], right, "the logits")
            if problem:
                return (f"a model's logits with yours patched into orthros.py (attn={attn!r}, "
                        f"swa_impl={swa_impl!r}, T={T}, w={w}, t_out={t_out}): {problem}")
    return whole_models
