"""The exercises stay true to the code, for every exercise the checks folder holds: the stored solution passes, the stub
is "not started", every known bug fails and is named. The checker itself, on a toy exercise, for what no mutant shows
(test_exercise_mutants.py). The command line, the hints, the picture, the syllabus."""

import ast
import inspect
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import orthros
import exercises.__main__ as commands
from exercises import framework
from exercises.__main__ import main
from exercises.framework import EXERCISES, Case, Result, checker_hook, load_spec, tensor_difference
from exercises.show import pattern

REPO = Path(__file__).resolve().parents[1]
NUMBERS = list(EXERCISES)
IDS = [EXERCISES[n] for n in NUMBERS]
NO_RUNS = {"runs": {"swa": "/nowhere/swa", "orthros": "/nowhere/orthros"}}   # the recall lab then waits


def test_the_recall_lab_passes_on_trained_runs(recall_runs):
    """The recall lab's reference passes its check on the two runs trained in this test session, whatever their task's
    window, depth and vocabulary (its checker reads them from the runs)."""
    spec = load_spec(10)
    result = framework.check(spec, spec.REFERENCE, runs={attn: str(path) for attn, path in recall_runs.items()})
    assert result.status == "PASS" and "beyond n_layer * w" in result.message, result.message


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_the_stored_solution_passes_and_every_known_bug_fails_named(n):
    """The whole file `solution N --show` prints, checked as a student's file, passes (the recall lab: its made-up
    runs, then it waits for trained ones). A copy of it with one classic mistake fails, and the report names it."""
    spec = load_spec(n)
    answer = framework.load_answer(spec, framework.solved_source(spec), f"/nowhere/{EXERCISES[n]}.py")
    result = framework.check(spec, answer, **NO_RUNS)
    assert result.status == ("waiting" if hasattr(spec, "DEFAULT_RUNS") else "PASS"), result.message
    for bug in spec.BUGS:
        result = framework.check(spec, bug, **NO_RUNS)
        assert result.status == "FAIL" and result.named == [bug.name] and f"known mistake: {bug.name}." in result.message, \
            result.message   # it alone: another bug alike on the smallest failing case does not do what it does after


@pytest.mark.parametrize("n", NUMBERS, ids=IDS)
def test_the_untouched_stub_and_the_second_hint(n):
    """The stub reports "not started", naming the function to write and how to start; each function has the
    reference's exact signature (names, order, defaults) and is the stub's own, never the function it replaces. No line
    of the reference's code (20 characters or more) appears in hint 2 (shapes or pseudocode)."""
    spec = load_spec(n)
    answer = framework.load_answer(spec, framework.stub_source(spec), framework.STUBS / f"{EXERCISES[n]}.py")
    result = framework.check(spec, answer, **NO_RUNS)
    assert result.status == "not started", "\n".join(commands.in_place(n, spec)) or result.message   # what `check` says
    assert any(f"`{f}`" in result.message for f in spec.FUNCTIONS), result.message
    assert "NotImplementedError" in result.message and f"python -m exercises start {n}" in result.message
    tree = ast.parse(framework.stub_source(spec))
    named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for name in spec.FUNCTIONS:
        assert inspect.signature(answer.functions[name]) == inspect.signature(getattr(spec.REFERENCE, name)), name
        assert answer.functions[name].__module__.startswith("_exercise_answer_"), name
        assert name not in named or getattr(spec.REFERENCE, name).__module__.startswith("exercises."), name
        for line in textwrap.dedent(inspect.getsource(inspect.unwrap(getattr(spec.REFERENCE, name)))).splitlines():
            code = re.sub(r"\s+", " ", line.split("#")[0].strip())
            assert len(code) < 20 or code.startswith(("def ", '"""')) or code not in re.sub(r"\s+", " ", spec.HINTS[1]), code


def test_exercise_1s_whole_model_cases_alone_catch_a_wrong_predicate():
    """Each whole-model case of exercise 1, swa_impl dense and blocked alike, fails an in_window that uses `<=`."""
    spec, cases = load_spec(1), [c for c in load_spec(1).cases() if "whole-model" in c.what]
    assert all(sum(f"swa_impl={impl!r}" in c.what for c in cases) >= 2 for impl in ("dense", "blocked")), cases
    for case in cases:
        assert framework.check(SimpleNamespace(**{**vars(spec), "cases": lambda **_: [case]}), spec.BUGS[0]).status == "FAIL"


# The checker itself, on a toy exercise: double every entry of x

LOG = []


def double(x, **context):
    LOG.append(("reference", x))
    return 2 * x


def toy(*cases, forbidden=None):
    return SimpleNamespace(__name__="toy", TITLE="toy", FUNCTIONS=("double",), BUGS=[],
                           REFERENCE=SimpleNamespace(double=double), FORBIDDEN=forbidden or {}, cases=lambda **_: list(cases))


def doubling(**more):
    return Case("double(x)", lambda: dict(x=torch.arange(6.0).view(2, 3)), "double", "2x", **more)


def test_an_error_in_the_checkers_own_code_is_not_the_students():
    """The checker's code failing after the answer returned, or inside the answer's call (a hook), is an ERROR; an
    exception raised by the answer's code is the answer's: its type, message and line."""
    after = Case("double(x), then a checker bug", dict(x=torch.arange(3.0)), lambda answer, x: torch.cat(
        [answer.double(x), torch.zeros(2, 2)]), "2x")
    inside = Case("double(x) through a checker's hook", dict(x=torch.arange(3.0)), lambda answer, x: answer.double(
        x, hook=checker_hook(lambda: 1 / 0)), "2x")
    for case in (after, inside):
        result = framework.check(toy(case), SimpleNamespace(double=lambda x, hook=None: 2 * x if hook is None else hook()))
        assert result.status == "ERROR" and "not your code" in result.message, result.message
    answer = framework.load_answer(toy(doubling()), "def double(x):\n    return x @ x.T.T\n", "/nowhere/ex99_toy.py")
    result = framework.check(toy(doubling()), answer)
    assert "your code raised RuntimeError" in result.message and "(at /nowhere/ex99_toy.py, line 2)" in result.message


def test_the_reference_first_on_its_own_inputs_then_forms_and_values_on_another_device_or_dtype():
    """Each case runs the reference before the answer, each on its own copy of the inputs. Case.device builds the inputs
    there (meta: forms only), Case.dtype converts them (and names them). Values are exact for integers and booleans; NaN
    where the reference has a number is wrong; NaN against NaN is right."""
    shared = torch.arange(6.0)
    LOG.clear()
    answer = SimpleNamespace(double=lambda x: LOG.append(("answer", x)) or x + x)
    assert framework.check(toy(Case("double(x)", lambda: dict(x=shared), "double", "2x")), answer).status == "PASS"
    assert [who for who, _ in LOG] == ["reference", "answer"] and len({id(x) for _, x in LOG} | {id(shared)}) == 3
    meta, wide = doubling(device="meta"), doubling(dtype=torch.float64)
    assert framework.check(toy(meta, wide), SimpleNamespace(double=lambda x: 2 * x)).status == "PASS"
    message = framework.check(toy(wide), SimpleNamespace(double=lambda x: (2 * x).float())).message
    assert "double(x), in float64" in message and "has dtype torch.float32, expected torch.float64" in message
    assert tensor_difference(torch.tensor([1, 2]), torch.tensor([1, 3]), 0, 0).startswith("1 of 2 entries differ")
    assert "1 of 1 entries" in tensor_difference(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0, 0)
    assert tensor_difference(torch.tensor([float("nan")]), torch.tensor([float("nan")]), 0, 0) is None


def test_refused_functions_raise_even_when_captured_before_the_check_and_are_restored():
    """A refused method captured at import time (f = Orthros.forward) raises while the answer runs, even if the answer
    catches it, and works again afterwards; so after Ctrl-C inside an answer, which stops the check."""
    captured, code, model = orthros.Orthros.forward, orthros.Orthros.forward.__code__, framework.tiny_model()
    def answer(x):
        try:
            captured(model, torch.zeros(1, 1, dtype=torch.long))
        except Exception:
            pass
        return 2 * x
    result = framework.check(toy(doubling(), forbidden={orthros.Orthros.forward: "it runs the model"}), SimpleNamespace(double=answer))
    assert "refused: your code called orthros.Orthros.forward (it runs the model)" in result.message, result.message
    assert orthros.Orthros.forward.__code__ is code and captured(model, torch.zeros(1, 1, dtype=torch.long))
    code = orthros.in_window.__code__
    with pytest.raises(KeyboardInterrupt):
        framework.check(toy(doubling(), forbidden={orthros.in_window: "the window"}),
                        SimpleNamespace(double=lambda x: (_ for _ in ()).throw(KeyboardInterrupt)))
    assert orthros.in_window.__code__ is code and not framework.STATE.active


# The command line, the hints, the picture, the syllabus

def cli(capsys, *args):
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return (code, *capsys.readouterr())


@pytest.mark.parametrize("args", [["check", str(max(NUMBERS) + 1)], ["check", "0"], ["check", "abc"], ["hint", "99"],
                                  ["solution", "0"], ["hint", "1", "7"], ["hint", "1", "x"], ["bogus"], ["new", "Bad-Name"]])
def test_command_line_errors_are_one_line(capsys, args):
    """A wrong exercise number, hint number, name or command: one line on stderr naming what is valid, exit != 0."""
    code, out, err = cli(capsys, *args)
    assert code not in (0, None) and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"from 1 to|hints 1 to|1, 2 or 3|choose from|lower-case", err), "say what is valid: " + err
    assert args != ["bogus"] or ("solution" not in err and "'new'" not in err)   # the teachers' commands are not advertised


def test_command_line_check_all_counts_every_exercise_and_ctrl_c_prints_one_line(capsys, monkeypatch):
    """`check ALL --solution` checks every exercise in the checks folder, and counts them; Ctrl-C while a check runs:
    one line on stderr, exit 130."""
    monkeypatch.setattr(framework, "check", lambda spec, answer, **options: Result("PASS"))
    code, out, _ = cli(capsys, "check", "ALL", "--solution")
    assert code == 0 and f"{len(NUMBERS)} of {len(NUMBERS)} PASS" in out, "expected every exercise counted: " + out
    monkeypatch.setattr(framework, "check", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    code, _, err = cli(capsys, "check", "1", "--solution")
    assert code == 130 and err.strip() == "python -m exercises: interrupted"


def test_command_line_solution_hint_and_list(capsys):
    """`solution N` points to the second hint; with --show it prints the whole solving file (exercise 1's: orthros.py's
    functions, copied); --help hides it. `hint 1 2` shows hint 2 of 3 and the command for the next. `list` shows every
    exercise of the checks folder, by number and title."""
    code, out, err = cli(capsys, "solution", "1")
    assert code == 1 and out == "" and "hint 1 2" in err and "--show" in err
    code, out, _ = cli(capsys, "solution", "1", "--yes-i-am-a-teacher")
    assert code == 0 and framework.solved_source(load_spec(1)) in out
    assert "solution" not in cli(capsys, "--help")[1]
    code, out, _ = cli(capsys, "hint", "1", "2")
    assert code == 0 and "hint 2 of 3" in out and "python -m exercises hint 1 3" in out
    code, out, _ = cli(capsys, "list")
    assert code == 0 and all(f"{n:>2}  {load_spec(n).TITLE}" in out for n in NUMBERS), out


def test_show_mask_draws_figure_1_from_orthros_and_the_syllabus_rows_are_true():
    """`show mask`: base rows see keys t-w+1 ... t; output rows see every key up to their twin's position. Each row of
    exercises/README.md's syllabus names an exercise by its checker's title and check command (a new exercise runs
    before its row is written); the main README links the page."""
    rows, t, j = pattern(16, 4, 4), torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert torch.equal(rows[:16], (j <= t) & (t - j < 4)) and torch.equal(rows[16:], j <= torch.arange(12, 16)[:, None])
    rows = [line for line in (REPO / "exercises" / "README.md").read_text().splitlines() if re.match(r"\| \d+ \|", line)]
    assert rows and all(load_spec(int(row.split("|")[1])).TITLE in row for row in rows), rows
    assert all(f"`python -m exercises check {int(row.split('|')[1])}`" in row for row in rows), rows
    assert "(exercises/README.md)" in (REPO / "README.md").read_text()


def test_the_exercises_are_numbered_once_and_counted_as_the_checks_folder_does(tmp_path):
    """Two checkers of one number (two teachers' branches merged) are an error naming both, not an exercise gone; every
    count of the exercises in words on the pages ("ten exercises") is the number of checkers."""
    for name in ("ex05_conversion.py", "ex05_my_topic.py", "ex06_reach.py"):
        (tmp_path / name).touch()
    with pytest.raises(ImportError, match="two checkers numbered 5, ex05_conversion.py and ex05_my_topic.py"):
        framework.numbered(tmp_path)
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
    for page in ("README.md", "exercises/README.md", "exercises/__init__.py"):
        for word in re.findall(rf"\b({'|'.join(words)})(?: [\w-]+)? exercises\b", (REPO / page).read_text().lower()):
            assert words.index(word) == len(EXERCISES), f"{page} counts {word} exercises"
