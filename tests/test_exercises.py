"""
What the tests prove: the ten exercises (exercises/, `python -m exercises`) stay true to the code.
For every exercise:

1. The reference passes its checker: orthros.py's (or bench.py's) own function for a "replace"
   exercise, the stored solution (exercises/solutions/) for a "build" one.
2. The untouched stub (exercises/exNN_*.py, as committed) reports "not started".
3. Every known-bug version fails, and the checker names it.
4. Every stub's signature equals the reference's.
5. No stub imports the function it replaces (nor reaches it through its module).
And: exercise 1's patch reaches every window path (a wrong predicate changes the dense AND the
blocked model's logits); a failure report gives the smallest failing case, its largest
difference, the invariant in words and the mistake's name; `show mask` draws Figure 1 from
orthros.py; the syllabus lists every exercise.

Run: python -m pytest -q test_exercises.py
The recall lab's reference check reads the recall_tiny runs of conftest.py's recall_tiny_runs,
trained once per test session and shared with test_train.py (alone, this file trains them first).
NOTE: these tests check the files as committed. A student's answers live in the same files:
check them with `python -m exercises check N`, not with this file.
"""

import ast
import inspect
import re
from pathlib import Path

from types import ModuleType

import pytest
import torch

import orthros
from exercises import framework
from exercises.__main__ import main
from exercises.framework import ORDER, difference, load
from exercises.show import pattern

NUMBERS = range(1, len(ORDER) + 1)
BUGS = [(n, bug.name) for n in NUMBERS for bug in load(n, solution=True)[0].BUGS]


def spec_of(n):
    return load(n, solution=True)[0]


@pytest.mark.parametrize("n", [n for n in NUMBERS if n != 10])
def test_reference_passes_its_check(n):
    """The reference (orthros.py's own function, or the stored solution) passes exercise n's check."""
    spec, reference = load(n, solution=True)
    result = framework.check(spec, reference)
    assert result.status == "PASS", result.message


def test_reference_passes_the_recall_lab_on_runs_of_this_session(recall_tiny_runs):
    """The recall lab's stored solution passes its check on recall_tiny runs trained in this test session."""
    spec, reference = load(10, solution=True)
    result = framework.check(spec, reference, runs=recall_tiny_runs)
    assert result.status == "PASS", result.message
    assert "beyond n_layer * w" in result.message


@pytest.mark.parametrize("n", NUMBERS)
def test_untouched_stub_is_not_started(n):
    """The stub as committed reports "not started", naming the function to write."""
    spec, stub = load(n)
    result = framework.check(spec, stub)
    assert result.status == "not started", result.message
    assert f"`{spec.FUNCTIONS[0]}`" in result.message and "NotImplementedError" in result.message


@pytest.mark.parametrize("n,name", BUGS, ids=[f"ex{n:02d}-{name}" for n, name in BUGS])
def test_known_bug_fails_and_is_named(n, name):
    """A copy of the reference with one classic mistake fails, and the report names that mistake."""
    spec = spec_of(n)
    bug = next(b for b in spec.BUGS if b.name == name)
    result = framework.check(spec, bug.impl)
    assert result.status == "FAIL", result.message
    assert name in result.named and f"known mistake: {name}." in result.message


@pytest.mark.parametrize("n", NUMBERS)
def test_stub_signature_equals_the_reference(n):
    """Each function the student writes has the reference's exact signature (names, order, defaults)."""
    spec, stub = load(n)
    for name in spec.FUNCTIONS:
        assert inspect.signature(getattr(stub, name)) == inspect.signature(getattr(spec.REFERENCE, name)), name


@pytest.mark.parametrize("n", NUMBERS)
def test_stub_does_not_import_what_it_replaces(n):
    """A stub defines its functions itself: it never imports, nor reaches through a module, the one it replaces."""
    spec, stub = load(n)
    tree = ast.parse(Path(stub.__file__).read_text())
    for name in spec.FUNCTIONS:
        assert getattr(stub, name).__module__ == stub.__name__, name
        if framework.reference_kind(getattr(spec.REFERENCE, name)) == "replace":
            imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
            reached = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            assert name not in imported | reached, name
    assert "solutions" not in Path(stub.__file__).read_text()


def test_an_imported_reference_is_refused():
    """A student file that imports the very function it replaces fails, rather than passing as the reference."""
    spec = spec_of(1)
    imported = ModuleType("exercises.ex01_window_mask")  # a student file that did `from orthros import ...`
    imported.in_window, imported.attention_mask = orthros.in_window, orthros.attention_mask
    result = framework.check(spec, imported)
    assert result.status == "FAIL" and "is the reference itself" in result.message


@pytest.mark.parametrize("swa_impl", ["dense", "blocked"])
def test_patched_in_window_reaches_every_window_path(swa_impl):
    """Exercise 1's whole-model cases alone catch a wrong predicate, with swa_impl dense and blocked alike."""
    spec = spec_of(1)
    wrong = next(b for b in spec.BUGS if b.name == "`<=` in the window").impl
    model_cases = [c for c in spec.cases() if "whole-model" in c.what and f"swa_impl={swa_impl!r}" in c.what]
    assert len(model_cases) >= 2
    for case in model_cases:
        assert difference(case.run(wrong), case.run(spec.REFERENCE), case.atol) is not None, case.what


def test_failure_report_gives_the_smallest_case_its_difference_and_the_invariant():
    """The report of a wrong answer shows the smallest failing case, the largest difference, the invariant and the mistake."""
    spec = spec_of(8)
    result = framework.check(spec, spec.BUGS[0].impl)
    lines = result.message.splitlines()
    assert lines[1].strip().startswith("blocked_sliding_window_attention(q, k, v, window=2)")  # (T, w) = (3, 2)
    assert re.search(r"largest difference [\d.e-]+ at index", result.message)
    assert "the invariant it breaks: equal to dense_sliding_window_attention" in result.message
    assert result.named == [spec.BUGS[0].name]


def test_command_line_check_hint_and_solution(capsys):
    """`check 1` on the stub says "not started" and exits 1; `hint 1 2` shows hint 2; `solution 1` prints orthros.py's source."""
    assert main(["check", "1"]) == 1
    assert "not started" in capsys.readouterr().out
    main(["hint", "1", "2"])
    assert "hint 2 of 3" in capsys.readouterr().out
    main(["solution", "1"])
    assert inspect.getsource(orthros.in_window) in capsys.readouterr().out


def test_show_mask_draws_figure_1_from_orthros():
    """The pattern of `show mask`: base rows see keys t-w+1 ... t; output rows see every key up to their twin's position."""
    T, w, t_out = 16, 4, 4
    rows = pattern(T, w, t_out)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(rows[:T], (j <= t) & (t - j < w))
    assert torch.equal(rows[T:], j <= torch.arange(T - t_out, T)[:, None])


def test_syllabus_lists_every_exercise():
    """exercises/README.md has a row per exercise with its title and its check command, and the README links it."""
    root = Path(__file__).resolve().parents[1]
    syllabus = (root / "exercises" / "README.md").read_text()
    for n in NUMBERS:
        row = next((line for line in syllabus.splitlines() if line.startswith(f"| {n} |")), "")
        assert spec_of(n).TITLE in row and f"`python -m exercises check {n}`" in row, n
    assert "(exercises/README.md)" in (root / "README.md").read_text()
