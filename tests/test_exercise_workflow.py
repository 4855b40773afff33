"""
A student's workflow with the exercises: `python -m exercises start N` copies the stub into
exercises/mine/ (git-ignored), `check N` checks that copy (or, without one, the stub, which says how
to start), and the test suite stays green whatever the student's files hold: the tests read the
stubs as committed.

    python -m pytest -q tests/test_exercise_workflow.py
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exercises import framework
from exercises.__main__ import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def classroom(tmp_path, monkeypatch):
    """The exercises as a student gets them: the committed stubs, and no exercises/mine/ yet."""
    stubs, mine = tmp_path / "exercises", tmp_path / "exercises" / "mine"
    stubs.mkdir()
    for n, name in enumerate(framework.ORDER, start=1):
        (stubs / f"{name}.py").write_text(framework.committed_stub(n))
    monkeypatch.setattr(framework, "STUBS", stubs)
    monkeypatch.setattr(framework, "MINE", mine)
    return stubs, mine


def test_start_copies_the_stub_and_check_reads_the_copy(classroom, capsys):
    """`start 2` writes exercises/mine/ex02_*.py from the stub; `check 2` then checks that file: "not
    started" while it is the stub, PASS once it holds a solution; a second `start 2` refuses in one line."""
    stubs, mine = classroom
    assert main(["start", "2"]) == 0
    copy = mine / "ex02_two_streams.py"
    assert copy.read_text() == (stubs / "ex02_two_streams.py").read_text()
    assert main(["check", "2"]) == 1
    out = capsys.readouterr().out
    assert "ex02_two_streams.py): not started" in out and "mine" in out
    copy.write_text(framework.solved_source(2))
    assert main(["check", "2"]) == 0 and ": PASS" in capsys.readouterr().out
    assert main(["start", "2"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "exists already" in err
    assert (stubs / "ex02_two_streams.py").read_text() == framework.committed_stub(2)   # the stub untouched


def test_check_without_a_copy_reads_the_stub_and_says_how_to_start(classroom, capsys):
    """Before `start`, `check 1` checks the stub itself (a student may also edit it in place): "not started",
    with the command that makes the student's own copy."""
    assert main(["check", "1"]) == 1
    out = capsys.readouterr().out
    assert "not started" in out and "python -m exercises start 1" in out


def test_start_all_makes_every_copy_once(classroom, capsys):
    """`start all` copies every stub not copied yet, and leaves the others alone."""
    stubs, mine = classroom
    mine.mkdir()
    (mine / "ex01_window_mask.py").write_text("# my work\n")
    assert main(["start", "all"]) == 0
    assert (mine / "ex01_window_mask.py").read_text() == "# my work\n"
    assert sorted(p.name for p in mine.glob("*.py")) == sorted(f"{name}.py" for name in framework.ORDER)


def test_exercises_mine_is_ignored_by_git():
    """exercises/mine/ is git-ignored: a student's answers never show up as changes to commit."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "exercises/mine/ex01_window_mask.py"], cwd=REPO)
    assert ignored.returncode == 0


def copy_of_the_repository(root):
    """The working tree's files (tracked and not ignored) in root, committed there as HEAD."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "the exercises as the class got them"], cwd=root, check=True)


def test_solved_exercises_leave_the_exercise_tests_green(tmp_path):
    """With every exercise solved, both in exercises/mine/ and edited in place in exercises/exNN_*.py, the
    exercise tests that read the student's files (stubs, command line) still pass, and `check` reads the
    student's copy."""
    root = tmp_path / "repo"
    copy_of_the_repository(root)
    (root / "exercises" / "mine").mkdir()
    for n, name in enumerate(framework.ORDER, start=1):
        solved = framework.solved_source(n)
        (root / "exercises" / "mine" / f"{name}.py").write_text(solved)
        (root / "exercises" / f"{name}.py").write_text(solved)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_exercises.py",
                            "-k", "stub or command_line"], cwd=root, env=env, capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
    checked = subprocess.run([sys.executable, "-m", "exercises", "check", "4"], cwd=root, env=env,
                             capture_output=True, text=True)
    assert checked.returncode == 0 and "(exercises/mine/ex04_algorithm1.py): PASS" in checked.stdout, checked.stdout
