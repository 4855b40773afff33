"""Each exercise's solution and another right answer pass, its stub is "not started", each wrong
answer of tests/exercise_mutants.md fails; the checkers' contract on a toy exercise; the CLI."""

import ast
import collections
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import exercises.__main__ as commands
import orthros
from exercises import framework
from exercises.__main__ import main
from exercises.framework import EXERCISES, Domain, Result, load_spec
from exercises.show import pattern

NUMBERS = list(EXERCISES)
IDS = [EXERCISES[n] for n in NUMBERS]
NO_RUNS = {"runs": {"swa": "/nowhere/swa", "orthros": "/nowhere/orthros"}}   # the recall lab waits


def test_the_recall_lab_passes_on_trained_runs(recall_runs):
    """The recall lab's reference passes on the two runs trained in this session (recall_micro)."""
    spec, runs = load_spec(10), {attn: str(path) for attn, path in recall_runs.items()}
    result = framework.check(spec, spec.REFERENCE, runs=runs)
    assert result.status == "PASS" and "beyond n_layer * w" in result.message, result.message


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_the_stored_solution_and_another_right_answer_pass_on_inputs_at_the_papers_sizes(n):
    """The solution and another right answer pass; an input is at the paper's sizes (PAPER)."""
    spec, also = load_spec(n), framework.SOLUTIONS / f"{EXERCISES[n]}_also.py"
    right = "waiting" if hasattr(spec, "DEFAULT_RUNS") else "PASS"
    also = getattr(spec, "ALSO_RIGHT", 0) or also.read_text()
    for source in (framework.solved_source(spec), also):
        answer = framework.load_answer(spec, source, f"/nowhere/{EXERCISES[n]}.py")
        result = framework.check(spec, answer, **NO_RUNS)
        assert result.status == right, result.message
    drawn = [framework.call_text(f, {}, params) for f in spec.FUNCTIONS
             for params in framework.draws(spec.DOMAIN[f])]
    assert any(spec.PAPER in text for text in drawn), spec.PAPER


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_the_untouched_stub_is_not_started(n):
    """The stub is "not started", naming how to start, with the solution's signatures."""
    spec = load_spec(n)
    stub = framework.stub_source(spec)
    answer = framework.load_answer(spec, stub, framework.STUBS / f"{EXERCISES[n]}.py")
    result = framework.check(spec, answer, **NO_RUNS)
    assert result.status == "not started", "\n".join(commands.in_place(n, spec)) or result.message
    assert any(f"`{f}`" in result.message for f in spec.FUNCTIONS), result.message
    assert "NotImplementedError" in result.message and f"exercises start {n}" in result.message
    imported = {a.name for node in ast.walk(ast.parse(stub)) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    solved = importlib.import_module(f"exercises.solutions.{EXERCISES[n]}")
    for name in spec.FUNCTIONS:
        assert inspect.signature(answer.functions[name]) == inspect.signature(getattr(solved, name))
        assert answer.functions[name].__module__.startswith("_exercise_") and name not in imported


Mutant = collections.namedtuple("Mutant", "n kind name expect edits")   # edits: [[old, new], ...]


def catalogue(path=Path(__file__).with_name("exercise_mutants.md")):
    found, kind = [], None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            kind = line.rsplit("(", 1)[-1].rstrip(")")
        elif line.startswith("### ex"):
            found.append(Mutant(int(line[6:8]), kind, line[10:], [], []))
        elif line.startswith("expect: "):
            found[-1].expect.extend(line[8:].split(" | "))
        elif line[:1] in ("-", "+") and found and kind:
            edits, side = found[-1].edits, line[0] == "+"
            if not edits or edits[-1][1] is not None and not side:
                edits.append([None, None])
            text = edits[-1][side]
            edits[-1][side] = line[1:] if text is None else f"{text}\n{line[1:]}"
    return found


MUTANTS = catalogue()


@pytest.mark.parametrize("m", MUTANTS, ids=[f"ex{m.n:02d}-{m.kind}-{m.name}" for m in MUTANTS])
def test_a_wrong_answer_fails_naming_the_property_and_the_input(m):
    source = framework.solved_source(load_spec(m.n))
    for old, new in m.edits:
        assert source.count(old) == 1, f"{m.name}: the solution holds {old!r} not once"
        source = source.replace(old, new)
    answer = framework.load_answer(load_spec(m.n), source, f"/nowhere/{EXERCISES[m.n]}.py")
    result = framework.check(load_spec(m.n), answer, summary=False, **NO_RUNS)
    assert result.status == "FAIL" and all(w in result.message for w in m.expect), result.message


# The contract itself, on a toy exercise: double every entry of x

def double(x):
    return 2 * x


def toy(**more):
    build = lambda seed, n, **_: dict(x=torch.arange(float(n)) + seed)
    domain = Domain(build, n=[0, 1, 2, 5], dtype=[torch.float64, torch.bfloat16])
    return SimpleNamespace(__name__="toy", FUNCTIONS=("double",), DOMAIN={"double": domain},
                           REFERENCE=SimpleNamespace(double=double), **more)


def check(answer, spec=None):
    return framework.check(spec or toy(), SimpleNamespace(double=answer))


def test_the_inputs_hold_every_value_every_pair_asked_and_come_smallest_first():
    """Every value, and every pair asked for, is in an input; meta last, the rest smallest first."""
    domain = Domain(pairs=[("a", "b")], draws=0, a=[0, 1, 2, 3], b=lambda a: [a, a + 10],
                    c=list("xyz"), place=["cpu", "meta"])
    drawn = framework.draws(domain)
    assert {(p["a"], p["b"] - p["a"]) for p in drawn} == {(a, d) for a in range(4) for d in (0, 10)}
    assert {p["c"] for p in drawn} == {"x", "y", "z"} and drawn[-1]["place"] == "meta"
    sizes = [p["a"] + p["b"] for p in drawn if p["place"] == "cpu"]
    assert sizes == sorted(sizes) and drawn == framework.draws(domain)


def test_each_property_fails_naming_it_and_the_smallest_input():
    """Each broken property is a FAIL naming it and the smallest input; the checker's bug: ERROR."""
    def kept(x, seen={}):
        return seen.setdefault((x.numel(), x.dtype), 2 * x)
    for answer, words in [
            (lambda x: 2 * x + (x.numel() == 5), "(values): your double differs from the reference "
             "at double(x=<5 "), (lambda x: x.mul_(2) if x.numel() else x, "(inputs)"),
            (lambda x: 2 * x.detach(), "(autograd)"), (kept, "(repeats)"),
            (lambda x: 2 * x if x.numel() < 2 else x.foo(), "(crash): your double crashed at "
             "double(x=<2 float64 tensor>), drawn with n=2, dtype=torch.float64: your code")]:
        result = check(answer)
        assert result.status == "FAIL" and words in result.message, result.message
    def prop(answer, **options):
        """a property whose own code fails"""
        return 1 / 0
    spec = toy(PROPERTIES=[prop])
    result = framework.check(spec, spec.REFERENCE)
    assert result.status == "ERROR" and "not your code" in result.message, result.message


def test_a_crash_never_passes_in_a_property_or_the_summary():
    """What the answer raises in a checker's property, or in its summary, is a FAIL, not a PASS."""
    def after_pass(answer, **options):
        return f"{answer.double(torch.ones(3))}{answer.double('no')}"
    def prop(answer, **options):
        """the double of a string"""
        answer.double("no")
    for spec in (toy(after_pass=after_pass), toy(PROPERTIES=[prop])):
        result = check(lambda x: 2 * x if isinstance(x, torch.Tensor) else x.foo(), spec)
        assert result.status == "FAIL" and "raised AttributeError" in result.message, result.message


def test_refused_functions_raise_even_when_captured_before_the_check_and_are_restored():
    """A refused method, even captured at import, raises while the answer runs, then works again."""
    captured, code = orthros.Orthros.forward, orthros.Orthros.forward.__code__
    model, idx = framework.tiny_model(), torch.zeros(1, 1, dtype=torch.long)
    def answer(x):
        try:
            captured(model, idx)
        except Exception:
            pass
        return 2 * x
    result = check(answer, toy(FORBIDDEN={orthros.Orthros.forward: "it runs the model"}))
    assert "(refused)" in result.message and "called orthros.Orthros.forward (it runs the " \
        "model)" in result.message, result.message
    assert orthros.Orthros.forward.__code__ is code and captured(model, idx)
    code, spec = orthros.in_window.__code__, toy(FORBIDDEN={orthros.in_window: "the window"})
    with pytest.raises(KeyboardInterrupt):
        check(lambda x: (_ for _ in ()).throw(KeyboardInterrupt), spec)
    assert orthros.in_window.__code__ is code and not framework.STATE.active


# The command line, the hints, the picture, the syllabus

def cli(capsys, *args):
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return (code, *capsys.readouterr())


@pytest.mark.parametrize("args", [
    ["check", str(max(NUMBERS) + 1)], ["check", "0"], ["check", "abc"], ["hint", "99"],
    ["solution", "0"], ["hint", "1", "7"], ["hint", "1", "x"], ["bogus"], ["new", "Bad-Name"]])
def test_command_line_errors_are_one_line(capsys, args):
    """A wrong number, name or command: one line on stderr naming what is valid, exit != 0."""
    code, out, err = cli(capsys, *args)
    assert code not in (0, None) and out == "" and len(err.strip().splitlines()) == 1, err
    assert re.search(r"one from 1, 2|hints 1 to|1, 2 or 3|choose from|lower-case", err), err
    assert args != ["bogus"] or ("solution" not in err and "'new'" not in err)


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def test_command_line_check_all_solution_and_ctrl_c(capsys, monkeypatch):
    """`solution N` is the teacher's; `check ALL` counts every exercise; Ctrl-C: one line, 130."""
    code, out, err = cli(capsys, "solution", "1")
    assert code == 1 and out == "" and "hint 1 2" in err
    code, out, _ = cli(capsys, "solution", "1", "--yes-i-am-a-teacher")
    assert code == 0 and framework.solved_source(load_spec(1)) in out
    monkeypatch.setattr(framework, "check", lambda spec, answer, **options: Result("PASS"))
    code, out, _ = cli(capsys, "check", "ALL", "--solution")
    assert code == 0 and f"{len(NUMBERS)} of {len(NUMBERS)} PASS" in out, out
    monkeypatch.setattr(framework, "check", interrupted)
    code, _, err = cli(capsys, "check", "1", "--solution")
    assert code == 130 and err.strip() == "python -m exercises: interrupted"


def test_show_mask_draws_figure_1_from_orthros():
    """`show mask`: base rows see keys t-w+1 ... t; output rows every key up to their twin's."""
    rows, t, j = pattern(16, 4, 4), torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert torch.equal(rows[:16], (j <= t) & (t - j < 4))
    assert torch.equal(rows[16:], j <= torch.arange(12, 16)[:, None])
