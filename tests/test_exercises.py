"""
What the tests prove: the ten exercises (exercises/, `python -m exercises`) stay true to the code,
and their checker is proven by the wrong answers it rejects. For every exercise:

1. The reference passes its checker: orthros.py's (or perf/bench.py's) own function for a
   "replace" exercise, the stored solution (exercises/solutions/) for a "build" one.
2. The stub as committed reports "not started" (whatever a student did to the working file).
3. Every known-bug version fails, and the checker names it (every mutant fails, saying why:
   tests/test_exercise_mutants.py, with the mutation score).
4. Every stub's signature equals the reference's; no stub imports the function it replaces.
The checker itself (exercises/framework.py): the reference runs first, on its own copy of the
inputs; an answer that changes its inputs fails, naming the input; what the checker refuses
raises while the answer runs, even when captured before, and everything is restored afterwards;
forms are compared before values; an error in the checker's own code is never the student's;
cases may run on another device (meta) or dtype. And the command line: one-line errors, Ctrl-C,
the teachers' solution command, `check all --solution`; the hints; the syllabus.
The student's workflow (start, check, a suite that stays green): tests/test_exercise_workflow.py.

Run: python -m pytest -q tests/test_exercises.py
The recall lab's reference check reads the recall_tiny runs of conftest.py's recall_tiny_runs,
trained once per test session and shared with test_train.py (alone, this file trains them first).
"""

import ast
import builtins
import inspect
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import orthros
from exercises import framework
from exercises.__main__ import main
from exercises.framework import ORDER, Case, Result, difference, load, load_spec
from exercises.show import pattern

REPO = Path(__file__).resolve().parents[1]
NUMBERS = range(1, len(ORDER) + 1)
BUGS = [(n, bug.name) for n in NUMBERS for bug in load_spec(n).BUGS]


def committed(n):
    """(spec, answer) for exercise n's stub as committed, loaded from its own path."""
    spec = load_spec(n)
    return spec, framework.load_answer(spec, framework.committed_stub(n), REPO / "exercises" / f"{ORDER[n - 1]}.py")


# -----------------------------------------------------------------------------
# Every exercise: the reference passes, the stub is not started, the wrong answers fail

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


def test_the_recall_lab_waits_for_its_runs(tmp_path):
    """Without trained runs, the recall lab's reference passes the made-up runs, then says it is waiting."""
    spec, reference = load(10, solution=True)
    result = framework.check(spec, reference, runs={"swa": str(tmp_path / "swa"), "orthros": str(tmp_path / "o")})
    assert result.status == "waiting" and "python train.py --config recall_tiny" in result.message


@pytest.mark.parametrize("n", NUMBERS)
def test_untouched_stub_is_not_started(n):
    """The stub as committed reports "not started", naming the function to write and how to start."""
    spec, stub = committed(n)
    result = framework.check(spec, stub)
    assert result.status == "not started", result.message
    assert f"`{spec.FUNCTIONS[0]}`" in result.message and "NotImplementedError" in result.message
    assert f"python -m exercises start {n}" in result.message


@pytest.mark.parametrize("n,name", BUGS, ids=[f"ex{n:02d}-{name}" for n, name in BUGS])
def test_known_bug_fails_and_is_named(n, name):
    """A copy of the reference with one classic mistake fails, and the report names that mistake."""
    spec = load_spec(n)
    bug = next(b for b in spec.BUGS if b.name == name)
    result = framework.check(spec, bug)
    assert result.status == "FAIL", result.message
    assert name in result.named and f"known mistake: {name}." in result.message


@pytest.mark.parametrize("n", NUMBERS)
def test_stub_signature_equals_the_reference(n):
    """Each function the student writes has the reference's exact signature (names, order, defaults)."""
    spec, stub = committed(n)
    for name in spec.FUNCTIONS:
        assert inspect.signature(getattr(stub, name)) == inspect.signature(getattr(spec.REFERENCE, name)), name


@pytest.mark.parametrize("n", NUMBERS)
def test_stub_does_not_import_what_it_replaces(n):
    """A stub defines its functions itself: it never imports, nor reaches through a module, the one it replaces."""
    spec, stub = committed(n)
    tree = ast.parse(framework.committed_stub(n))
    for name in spec.FUNCTIONS:
        assert getattr(stub, name).__module__.startswith("_exercise_answer_"), name   # defined in the stub
        if framework.reference_kind(getattr(spec.REFERENCE, name)) == "replace":
            imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
            reached = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            assert name not in imported | reached, name
    assert "solutions" not in framework.committed_stub(n) and stub.problem is None


@pytest.mark.parametrize("swa_impl", ["dense", "blocked"])
def test_patched_in_window_reaches_every_window_path(swa_impl):
    """Exercise 1's whole-model cases alone catch a wrong predicate, with swa_impl dense and blocked alike."""
    spec = load_spec(1)
    wrong = next(b for b in spec.BUGS if b.name == "`<=` in the window")
    whole_model = [c for c in spec.cases() if "whole-model" in c.what and f"swa_impl={swa_impl!r}" in c.what]
    assert len(whole_model) >= 2
    for case in whole_model:
        only_this = SimpleNamespace(**{**vars(spec), "cases": lambda case=case, **options: [case]})
        assert framework.check(only_this, wrong).status == "FAIL", case.what


def test_failure_report_gives_the_smallest_case_its_difference_and_the_invariant():
    """The report of a wrong answer shows the smallest failing case, the largest difference, the invariant and the mistake."""
    spec = load_spec(8)
    result = framework.check(spec, spec.BUGS[0])
    lines = result.message.splitlines()
    assert lines[1].strip().startswith("blocked_sliding_window_attention(q, k, v, window=2)")  # (T, w) = (3, 2)
    assert re.search(r"largest difference [\d.e-]+ at index", result.message)
    assert "the invariant it breaks: equal to orthros.reference_attention" in result.message
    assert result.named == [spec.BUGS[0].name]


# -----------------------------------------------------------------------------
# The checker itself, on a toy exercise: double every entry of x

LOG = []


def double(x):
    LOG.append(("reference", x))
    return 2 * x


def toy(*cases, forbidden=None):
    """A one-function exercise spec with these cases."""
    return SimpleNamespace(TITLE="toy", FUNCTIONS=("double",), REFERENCE=SimpleNamespace(double=double),
                           FORBIDDEN=forbidden or {}, BUGS=[], cases=lambda **options: list(cases))


def doubling():
    return Case("double(x), x of shape (2, 3)", inputs=lambda: dict(x=torch.arange(6.0).view(2, 3)),
                call=lambda answer, x: answer.double(x), invariant="2x")


def test_the_reference_runs_first_on_its_own_copy_of_the_inputs():
    """Each case runs the reference before the answer, and each gets its own copy of the inputs."""
    shared = torch.arange(6.0).view(2, 3)
    case = Case("double(x)", inputs=lambda: dict(x=shared), call=lambda answer, x: answer.double(x), invariant="2x")

    def answer(x):
        LOG.append(("answer", x))
        return x + x

    LOG.clear()
    assert framework.check(toy(case, case), SimpleNamespace(double=answer)).status == "PASS"
    assert [who for who, _ in LOG] == ["reference", "answer"] * 2
    assert len({id(x) for _, x in LOG} | {id(shared)}) == 5   # every run its own x, never the original


@pytest.mark.parametrize("change,expected", [
    (lambda x, **_: x.add_(1), "your double changed its input `x` in place (6 of 6 entries differ)"),
    (lambda x, model, **_: model.train(), "changed its input `model`: `model.training` was False, now True"),
    (lambda x, model, **_: model.blocks[0].attn.alpha.data.mul_(2),
     "changed its input `model`: `model.blocks.0.attn.alpha` changed in place (16 of 16 entries differ)"),
    (lambda x, config, **_: setattr(config, "window", 3), "changed its input `config`: `config.window` was 4, now 3"),
    (lambda x, cache, **_: cache.layers.append(orthros.LayerCache()),
     "changed its input `cache`: `cache.layers[2]` is new"),
])
def test_an_answer_that_changes_its_inputs_fails_naming_the_input(change, expected):
    """Tensors by value, models' weights and modes, configs, caches: a change is reported with its path."""
    model = framework.tiny_model()
    case = Case("double(x), with a model, its config and a cache at hand",
                inputs=lambda: dict(x=torch.arange(6.0), config=model.config, cache=orthros.KVCache(model, 1),
                                    model=model),
                call=lambda answer, x, model, config, cache: answer.double(x, model=model, config=config, cache=cache),
                invariant="2x")
    spec = toy(case)
    spec.REFERENCE = SimpleNamespace(double=lambda x, **context: 2 * x)

    def answer(x, **context):
        y = 2 * x
        change(x, **context)
        return y

    result = framework.check(spec, SimpleNamespace(double=answer))
    assert result.status == "FAIL" and expected in result.message, result.message


def test_an_input_declared_mutable_may_change():
    """A case may name inputs the answer is meant to change (a cache it appends to)."""
    case = Case("double(x)", inputs=lambda: dict(x=torch.arange(3.0)), call=lambda answer, x: answer.double(x),
                invariant="2x", mutable=("x",))
    assert framework.check(toy(case), SimpleNamespace(double=lambda x: 2 * x.add_(0))).status == "PASS"


def test_forms_are_compared_before_values():
    """Type, shape, dtype and device are reported before any value is compared or touched."""
    case = doubling()
    for answer, expected in [(lambda x: (2 * x).tolist(), "what your double returned is a list of 2 items, "
                                                          "expected a tensor of shape (2, 3) (torch.float32)"),
                             (lambda x: (2 * x).flatten(), "has shape (6,), expected (2, 3)"),
                             (lambda x: (2 * x).double(), "has dtype torch.float64, expected torch.float32")]:
        result = framework.check(toy(case), SimpleNamespace(double=answer))
        assert result.status == "FAIL" and expected in result.message, result.message


def test_a_return_is_checked_in_form_before_the_checker_uses_it():
    """Exercise 9 (issue 18, item 4): logits of shape (B, vocab) are reported as such, not as the
    RuntimeError that the checker's own code would raise on them."""
    spec = load_spec(9)
    result = framework.check(spec, next(m for m in spec.MUTANTS if m.name == "logits of shape (B, vocab)"))
    assert "what is wrong: your logits have shape (2, 37), expected (2, 1, 37)" in result.message
    assert "raised" not in result.message


def test_an_error_in_the_checkers_own_code_is_not_the_students():
    """When the checker's code fails after the answer returned, the report says so, with status ERROR."""
    case = Case("double(x), then a checker bug", inputs=lambda: dict(x=torch.arange(3.0)),
                call=lambda answer, x: torch.cat([answer.double(x), torch.zeros(2, 2)]), invariant="2x")
    result = framework.check(toy(case), SimpleNamespace(double=lambda x: 2 * x))
    assert result.status == "ERROR" and "not your code" in result.message
    assert "your code raised" not in result.message


def test_an_error_in_the_answer_is_reported_where_it_happened():
    """An exception raised by the answer's code is the answer's: its type, message and line."""
    source = "def double(x):\n    return x @ x.T.T\n"
    answer = framework.load_answer(toy(doubling()), source, "/nowhere/ex99_toy.py")
    result = framework.check(toy(doubling()), answer)
    assert result.status == "FAIL" and "your code raised RuntimeError" in result.message
    assert "(at /nowhere/ex99_toy.py, line 2)" in result.message


def test_cases_may_run_on_another_device_or_dtype():
    """Case.device moves the inputs (meta: forms only, no values); Case.dtype converts them; a device
    this machine lacks skips the case."""
    on_meta = Case("double(x) on meta", inputs=lambda: dict(x=torch.arange(6.0)),
                   call=lambda answer, x: answer.double(x), invariant="2x", device="meta")
    in_double = Case("double(x) in float64", inputs=lambda: dict(x=torch.arange(6.0)),
                     call=lambda answer, x: answer.double(x), invariant="2x", dtype=torch.float64)
    assert framework.check(toy(on_meta, in_double), SimpleNamespace(double=lambda x: 2 * x)).status == "PASS"
    wrong_device = framework.check(toy(on_meta), SimpleNamespace(double=lambda x: torch.zeros(6)))
    assert "is on cpu, expected meta" in wrong_device.message
    wrong_dtype = framework.check(toy(in_double), SimpleNamespace(double=lambda x: (2 * x).float()))
    assert "has dtype torch.float32, expected torch.float64" in wrong_dtype.message
    if not torch.cuda.is_available():
        on_cuda = Case("double(x) on cuda", inputs=lambda: dict(x=torch.arange(6.0)),
                       call=lambda answer, x: answer.double(x), invariant="2x", device="cuda")
        result = framework.check(toy(on_cuda), SimpleNamespace(double=lambda x: 2 * x))
        assert result.status == "PASS" and result.skipped == ["double(x) on cuda"]


# -----------------------------------------------------------------------------
# What the checker refuses while an answer runs

def test_refused_functions_raise_even_when_captured_before_the_check():
    """A refused method captured at import time (f = Orthros.forward) raises while the answer runs, and
    works again afterwards: the guard patches the function itself, and restores it."""
    captured, code = orthros.Orthros.forward, orthros.Orthros.forward.__code__
    model = framework.tiny_model()
    case = Case("double(x) next to a model", inputs=lambda: dict(x=torch.arange(3.0), model=model),
                call=lambda answer, x, model: answer.double(x, model), invariant="2x")
    spec = toy(case, forbidden={orthros.Orthros.forward: "it runs the model"})
    spec.REFERENCE = SimpleNamespace(double=lambda x, model: 2 * x)

    def answer(x, model):
        captured(model, torch.zeros(1, 1, dtype=torch.long))
        return 2 * x

    result = framework.check(spec, SimpleNamespace(double=answer))
    assert "refused: your code called orthros.Orthros.forward (it runs the model)" in result.message
    assert orthros.Orthros.forward.__code__ is code and captured(model, torch.zeros(1, 1, dtype=torch.long))
    assert framework._BLOCKER not in sys.meta_path and not hasattr(builtins, "__orthros_exercise_guard__")
    assert "exercises.framework" in sys.modules and "exercises.solutions.ex02_two_streams" in sys.modules


def test_a_refusal_the_answer_catches_still_fails():
    """An answer that catches the refusal and carries on fails all the same."""
    source = ("from orthros import Orthros\n\n\ndef two_stream_logits(model, idx, t_out):\n    try:\n"
              "        return model(idx, t_out=t_out)[0]\n    except Exception:\n"
              "        return model.lm_head(model.wte(idx)[:, -t_out:])\n")
    spec = load_spec(2)
    result = framework.check(spec, framework.load_answer(spec, source, "/nowhere/ex02_caught.py"))
    assert result.status == "FAIL" and "refused: your code called orthros.Orthros.forward" in result.message


def test_a_shortcut_held_in_a_closure_is_refused_before_running():
    """A function whose closure holds the reference is refused, with a message saying so."""
    source = ("import orthros\n\n\ndef make():\n    reference = orthros.in_window\n\n"
              "    def in_window(q_pos, k_pos, window):\n        return reference(q_pos, k_pos, window)\n"
              "    return in_window\n\n\nin_window = make()\n\n\n"
              "def attention_mask(n_q, n_k, window=None, device=None):\n    raise NotImplementedError\n")
    spec = load_spec(1)
    result = framework.check(spec, framework.load_answer(spec, source, "/nowhere/ex01_closure.py"))
    assert result.status == "FAIL"
    assert "the closure of your `in_window` holds orthros.in_window, which this exercise refuses" in result.message


def test_the_exercise_modules_are_hidden_while_an_answer_runs():
    """While an answer runs, exercises/ (solutions, checks, framework) can be neither imported nor found."""
    seen = {}

    def answer(x):
        seen["modules"] = [name for name in sys.modules if name.split(".")[0] == "exercises"]
        try:
            import exercises.framework  # noqa: F401
        except ImportError as e:
            seen["import"] = str(e)
        return 2 * x

    framework.check(toy(doubling()), SimpleNamespace(double=answer))
    assert seen["modules"] == [] and "is not available to your code" in seen["import"]


def test_the_guard_is_restored_after_ctrl_c():
    """Ctrl-C inside an answer stops the check and leaves nothing patched."""
    code = orthros.in_window.__code__

    def answer(x):
        raise KeyboardInterrupt

    load_spec(1)
    with pytest.raises(KeyboardInterrupt):
        framework.check(toy(doubling()), SimpleNamespace(double=answer))
    assert orthros.in_window.__code__ is code and framework._BLOCKER not in sys.meta_path
    assert not framework.GUARD.active and "exercises.checks.ex01_window_mask" in sys.modules


# -----------------------------------------------------------------------------
# The command line

def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args", [["check", "11"], ["check", "0"], ["check", "abc"], ["hint", "11"],
                                  ["solution", "0"], ["hint", "1", "7"], ["hint", "1", "x"], ["start", "12"],
                                  ["bogus"]])
def test_command_line_errors_are_one_line(capsys, args):
    """A wrong exercise number, hint number or command: one line on stderr naming what is valid, no traceback, exit != 0."""
    try:
        code, out, err = run_cli(capsys, *args)
    except SystemExit as e:
        code, (out, err) = e.code, capsys.readouterr()
    assert code not in (0, None) and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"1 to 10|hints 1 to 3|1, 2 or 3|choose from", err), err
    assert args != ["bogus"] or "solution" not in err   # the teachers' command is not advertised


def test_command_line_check_accepts_all_in_any_case(capsys, monkeypatch):
    """`check ALL` (any case) checks every exercise."""
    checked = []
    monkeypatch.setattr(framework, "check", lambda spec, answer, **options: checked.append(spec.TITLE) or Result("PASS"))
    code, out, _ = run_cli(capsys, "check", "ALL", "--solution")
    assert code == 0 and len(checked) == 10 and "10 of 10 PASS" in out


def test_command_line_ctrl_c_during_a_check_prints_one_line(capsys, monkeypatch):
    """Ctrl-C while a check runs: one line on stderr, exit 130."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(framework, "check", interrupted)
    code, _, err = run_cli(capsys, "check", "1", "--solution")
    assert code == 130 and err.strip() == "python -m exercises: interrupted"


def test_command_line_ctrl_c_while_torch_loads_prints_one_line():
    """A real SIGINT while `python -m exercises` is still importing torch: one line on stderr, exit 130."""
    import signal
    import subprocess
    import time
    proc = subprocess.Popen([sys.executable, "-m", "exercises", "list"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # inside `import torch` (over a second)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "python -m exercises: interrupted", err


def test_command_line_solution_is_for_teachers(capsys):
    """`solution N` first points to the second hint; with --show (or --yes-i-am-a-teacher) it prints a whole
    solving file; --help does not advertise it."""
    code, out, err = run_cli(capsys, "solution", "1")
    assert code == 1 and out == "" and "hint 1 2" in err and "--show" in err
    code, out, _ = run_cli(capsys, "solution", "1", "--yes-i-am-a-teacher")
    assert code == 0 and inspect.getsource(orthros.in_window) in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "solution" not in capsys.readouterr().out


def test_command_line_hint(capsys):
    """`hint 1 2` shows hint 2 of 3 and the command for the next."""
    code, out, _ = run_cli(capsys, "hint", "1", "2")
    assert code == 0 and "hint 2 of 3" in out and "python -m exercises hint 1 3" in out


def test_check_all_solution_passes_and_waits_for_the_recall_runs(capsys, tmp_path):
    """`check all --solution` without trained runs: 9 PASS, exercise 10 waiting (not FAIL), exit 0."""
    code, out, _ = run_cli(capsys, "check", "all", "--solution", "--runs",
                           f"swa={tmp_path / 'swa'},orthros={tmp_path / 'orthros'}")
    assert "exercise 10, The recall lab (the reference): waiting" in out
    assert "9 of 10 PASS; 1 waiting (exercise 10)" in out and code == 0, out


# -----------------------------------------------------------------------------
# Hints, the picture, the syllabus

@pytest.mark.parametrize("n", NUMBERS)
def test_second_hint_gives_shapes_or_pseudocode_not_the_code(n):
    """No line of the reference's code (20 characters or more) appears in hint 2."""
    spec = load_spec(n)
    hint = re.sub(r"\s+", " ", spec.HINTS[1])
    for name in spec.FUNCTIONS:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(getattr(spec.REFERENCE, name))))
        body = ast.get_docstring(ast.parse(source).body[0]) or ""
        for line in source.splitlines():
            code = re.sub(r"\s+", " ", line.split("#")[0].strip())
            if len(code) >= 20 and code not in body and not code.startswith(("def ", '"""')):
                assert code not in hint, (name, code)


def test_show_mask_draws_figure_1_from_orthros():
    """The pattern of `show mask`: base rows see keys t-w+1 ... t; output rows see every key up to their twin's position."""
    T, w, t_out = 16, 4, 4
    rows = pattern(T, w, t_out)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(rows[:T], (j <= t) & (t - j < w))
    assert torch.equal(rows[T:], j <= torch.arange(T - t_out, T)[:, None])


def test_syllabus_lists_every_exercise():
    """exercises/README.md has a row per exercise with its title and its check command, and the README links it."""
    syllabus = (REPO / "exercises" / "README.md").read_text()
    for n in NUMBERS:
        row = next((line for line in syllabus.splitlines() if line.startswith(f"| {n} |")), "")
        assert load_spec(n).TITLE in row and f"`python -m exercises check {n}`" in row, n
    assert "(exercises/README.md)" in (REPO / "README.md").read_text()


def test_difference_reports_nan_and_exact_values():
    """difference(): exact for integers and booleans, NaN where the reference has none is wrong."""
    assert difference(torch.tensor([1, 2]), torch.tensor([1, 3])).startswith("1 of 2 entries differ")
    assert "NaN" in difference(torch.tensor([float("nan")]), torch.tensor([1.0]), atol=1.0)
    assert difference(torch.tensor([1.0]), torch.tensor([1.0 + 1e-13]), atol=1e-12) is None
