"""A student's `start N` and `check N`, a teacher's `new NAME`; the exercise tests stay green
whatever the student's files hold, with an exercise added, and in a copy with no git repository."""

import contextlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import test_exercises

import exercises.__main__ as cli
import orthros
from exercises import framework
from exercises.__main__ import main
from exercises.framework import EXERCISES, load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def mine(tmp_path, monkeypatch):
    """The student's folder, empty: exercises/mine/ of a class that has not started."""
    for module in (framework, cli):
        monkeypatch.setattr(module, "MINE", tmp_path / "mine")
    return tmp_path / "mine"


def test_start_copies_the_stub_and_check_reads_the_copy(mine, capsys):
    """`start 2` copies the stub to the git-ignored mine/, which `check 2` checks; `start all`."""
    assert main(["check", "1"]) == 1
    out = capsys.readouterr().out
    assert "not started" in out and "python -m exercises start 1" in out
    assert main(["start", "2"]) == 0
    copy = mine / f"{EXERCISES[2]}.py"
    assert copy.read_text() == framework.stub_source(load_spec(2))
    assert main(["check", "2"]) == 1 and "not started" in capsys.readouterr().out
    copy.write_text(framework.solved_source(load_spec(2)))
    assert main(["check", "2"]) == 0 and ": PASS" in capsys.readouterr().out
    assert main(["start", "2"]) == 1 and "exists already" in capsys.readouterr().err
    assert main(["start", "all"]) == 0 and copy.read_text() == framework.solved_source(load_spec(2))
    assert sorted(p.stem for p in mine.glob("*.py")) == sorted(EXERCISES.values())
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "exercises/mine/ex01.py"],
                             cwd=REPO, capture_output=True).returncode   # 128: no git repository
    assert ignored == 0 or ignored == 128 and "exercises/mine/" in (REPO / ".gitignore").read_text()


@pytest.mark.parametrize("where", ["beside the stubs", "in the stub"])
def test_an_answer_written_in_place_is_not_checked_and_check_says_so(mine, tmp_path, monkeypatch,
                                                                     capsys, where):
    """An answer beside the stubs or in one is not checked: `check` says so, and the suite too."""
    spec, stubs = load_spec(4), tmp_path / "stubs"
    shutil.copytree(framework.STUBS, stubs)
    monkeypatch.setattr(framework, "HERE", tmp_path)
    for module in (framework, cli):
        monkeypatch.setattr(module, "STUBS", stubs)
    answer = (tmp_path if where == "beside the stubs" else stubs) / f"{EXERCISES[4]}.py"
    answer.write_text(framework.solved_source(spec))
    shutil.copy(REPO / "exercises" / "hints.md", tmp_path)
    assert main(["check", "4"]) == 1
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NOTE:")]
    assert len(note) == 1 and "is not checked" in note[0] and f"mine/{EXERCISES[4]}.py" in note[0]
    failing = pytest.raises(AssertionError, match=re.escape(note[0]))
    with failing if where == "in the stub" else contextlib.nullcontext():
        test_exercises.test_the_untouched_stub_is_not_started(4)


def copy_of_the_repository(source, root, teacher):
    """source's course committed in root, every exercise solved in mine/ (one half-finished) and in
    place; with teacher, `new tiny_lab` and all committed. Returns the files git shows changed."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=t@example.com",
                               "-c", "commit.gpgsign=false", *args], cwd=root, check=True,
                              capture_output=True, text=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=source, capture_output=True, text=True).stdout.split("\0")
    for name in listed if listed != [""] else map(str, source.rglob("*")):   # (an archive: no git)
        name = os.path.relpath(source / name, source)
        if (source / name).is_file() and not re.match(r"exercises/(mine/|ex\d\d_)", name):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, root / name)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the class's course"]):
        git(*args)
    (root / "exercises" / "mine").mkdir()
    for n, name in EXERCISES.items():
        solved = framework.solved_source(load_spec(n))
        (root / "exercises" / f"{name}.py").write_text(solved)
        half = solved.replace("    return ", "    1 / 0\n    return ", 1)
        (root / "exercises" / "mine" / f"{name}.py").write_text(half if n == 3 else solved)
    folders = {name: root / "exercises" / name.lower() for name in ("STUBS", "CHECKS")}
    with mock.patch.multiple(framework, HERE=root / "exercises", **folders):
        assert not teacher or main(["new", "tiny_lab"]) == 0
    changed = git("status", "--porcelain", "--untracked-files=all").stdout.split()
    for args in [["add", "-A"], ["add", "-f", "exercises/mine"], ["commit", "-qm", "x"]] * teacher:
        git(*args)
    return sorted(set(changed) - {"??", "M"})


def test_the_tests_pass_in_a_copy_with_answers_everywhere_a_new_exercise_and_an_archive(tmp_path):
    """With answers everywhere, `new`'s exercise and orthros.py's locals renamed, the student's
    tests, the new exercise's and exercises 1 and 8's pass in an archive (no git repository)."""
    root, n = tmp_path / "copy", max(EXERCISES) + 1
    answers = [f"exercises/{name}.py" for name in EXERCISES.values()]
    written = [f"exercises/{part}/ex{n}_tiny_lab.py" for part in ("checks", "solutions", "stubs")]
    assert copy_of_the_repository(REPO, root, True) == sorted(answers + written
                                                              + ["exercises/hints.md"])
    for fn, old, new in [(orthros.in_window, "causal", "seen"),
                         (orthros.blocked_sliding_window_attention, "n_blocks", "count")]:
        path, body = root / Path(inspect.getfile(fn)).relative_to(REPO), inspect.getsource(fn)
        assert re.search(rf"\b{old}\b", body) and body in path.read_text(), (fn, old)
        path.write_text(path.read_text().replace(body, re.sub(rf"\b{old}\b", new, body)))
    assert copy_of_the_repository(root, tmp_path / "again", False) == answers
    shutil.copytree(tmp_path / "again", tmp_path / "archive", ignore=shutil.ignore_patterns(".git"))
    tests = "start_copies or answer_written or stub or command_line or tiny_lab or ex01 or ex08"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          "-k", tests, "tests/test_exercises.py", "tests/test_exercise_workflow.py"],
                         cwd=tmp_path / "archive", capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0 and run.stdout.count(f"[ex{n}_tiny_lab]") == 2, run.stdout[-4000:]
