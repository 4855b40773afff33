"""
The documents stay true to the code: the README's map from the paper to orthros.py, its set-up
commands (the ones CI runs), its links; the run metadata that the result files record; and the
data scripts' --help.

    python -m pytest -q tests/test_docs.py
"""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_alg_map():
    """Each '# Alg. X, line Y' mark of the README's table is a comment in orthros.py exactly once; none is missing."""
    table = re.findall(r"^\|.*\| `(# Alg\. [12], lines? [\d-]+)` \|$", README, re.M)
    code = re.findall(r"# Alg\. [12], lines? [\d-]+", (REPO / "orthros.py").read_text())
    assert len(table) == len(set(table)) == 16
    assert sorted(code) == sorted(table)


def commands(text):
    """The command lines of a shell text, without comments and blank lines."""
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def test_ci_runs_the_readmes_set_up_commands():
    """The README's two set-up commands (install, test) are what CI runs, literally, after its torch pin."""
    block = README.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    readme = [line for line in commands(block) if not line.startswith(("python -m venv", "pip install torch"))]
    ci = [line.replace("python -m pip", "pip") for line in commands((REPO / ".ci" / "run").read_text())
          if line.startswith("python")]
    assert ci[0].startswith("pip install --quiet torch==")
    assert readme == ci[1:] and readme[-1] == "python -m pytest -q", (readme, ci)


def test_readme_install_says_which_torch_arrives_and_how_to_get_the_cpu_build():
    """The install block warns that PyPI's torch is a CUDA build, and gives the command for the CPU build first."""
    block = README.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "CUDA build" in block and "pip install torch --index-url https://download.pytorch.org/whl/cpu" in block
    assert block.index("whl/cpu") < block.index("pip install -r requirements-test.txt")


def anchors(markdown):
    """The anchors GitHub gives a page's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", markdown, re.M)}


@pytest.mark.parametrize("page", ["README.md", "results/README.md", "exercises/README.md"])
def test_links_lead_somewhere(page):
    """Every relative link of the user-facing pages names a file that exists, and an anchor its page has."""
    text = (REPO / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path
        assert file.exists(), f"{page} links {target}: no such file"
        if anchor:
            assert anchor in anchors(file.read_text()), f"{page} links {target}: no such heading"


def test_readmes_cpt_command_is_the_recipe_behind_the_results(capsys):
    """The README's continued pre-training of SmolLM2 trains as the run whose numbers the results
    give (its command, in results/smollm2_cpt.json): all options alike but paths, evals, logs."""
    import json
    import shlex
    import train
    command = re.search(r"^python train.py --init_from hf:models/SmolLM2.*\\\n.*$", README, re.M)[0]
    readme = shlex.split(command.replace("\\\n", " "))
    recorded = json.loads((REPO / "results" / "smollm2_cpt.json").read_text())["orthros"]["command"]
    ignored = ("init_from", "dataset", "out_dir", "overwrite", "eval_interval", "eval_iters",
               "log_interval")
    options = lambda words: {k: v for k, v in vars(train.parse_args(words)[1]).items()
                             if k not in ignored}
    assert options(readme[2:]) == options(shlex.split(recorded)[1:])


# -----------------------------------------------------------------------------
# What a result file records about where it was measured (perf/bench.py's run_meta)

def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_run_metadata_names_the_commit_and_whether_the_tree_was_clean(tmp_path, monkeypatch):
    """run_meta records the checked-out commit and whether tracked files had changes; the environment
    (ORTHROS_GIT_COMMIT / ORTHROS_GIT_CLEAN, for a copied tree with a stale .git) overrides git; no git: None."""
    import checkpoint as bench
    monkeypatch.delenv("ORTHROS_GIT_COMMIT", raising=False)
    monkeypatch.delenv("ORTHROS_GIT_CLEAN", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "f.txt").write_text("one")
    git(repo, "add", "f.txt")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(bench, "REPO", repo)
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert bench.git_state() == (head, True)
    (repo / "f.txt").write_text("two")                      # a tracked file changed: not clean
    assert bench.git_state() == (head, False)
    (repo / "f.txt").write_text("one")
    (repo / "new.txt").write_text("untracked")              # untracked files don't count
    assert bench.git_state() == (head, True)
    assert bench.run_meta()["git_commit"] == head and bench.run_meta()["git_clean"] is True
    monkeypatch.setenv("ORTHROS_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("ORTHROS_GIT_CLEAN", "0")
    assert bench.git_state() == ("abc1234", False)
    monkeypatch.delenv("ORTHROS_GIT_COMMIT")
    monkeypatch.setattr(bench, "REPO", tmp_path / "nowhere")  # not a git checkout at all
    (tmp_path / "nowhere").mkdir()
    assert bench.git_state() == (None, None)


# -----------------------------------------------------------------------------
# Every script answers --help, and only that

SCRIPTS = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("data/*.py"), *REPO.glob("data/*/*.py")]
                 if 'if __name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_data_script_answers_help_without_doing_anything(script, monkeypatch, capsys):
    """`python data/.../script.py --help` prints its usage and exits 0, writing and fetching nothing."""
    files = lambda: {p: p.stat().st_mtime_ns for p in (REPO / "data").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    before = files()
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert done.value.code in (0, None) and capsys.readouterr().out.startswith("usage:")
    assert files() == before
