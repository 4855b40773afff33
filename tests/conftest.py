"""Shared pytest fixtures for the tests in this folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `pytest tests/` from anywhere: import from the repository root


@pytest.fixture(scope="session")
def recall_runs(tmp_path_factory):
    """The recall_micro config trained once per test session, for SWA and Orthros: {attn: out_dir}.
    test_train.py's recall test and exercise 10's check both read them. The two runs train at the
    same time, one CPU thread each: on 2 cores that is about half a minute for both."""
    from data.prepare_utils import find_dataset
    find_dataset("recall_micro")  # prepared once, before the two processes read it
    root = tmp_path_factory.mktemp("recall_micro")
    runs = {attn: root / attn for attn in ("swa", "orthros")}
    procs = {attn: subprocess.Popen([sys.executable, "train.py", "--config", "recall_micro", "--attn", attn, "--device", "cpu",
                                     "--out_dir", str(out)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for attn, out in runs.items()}
    for attn, proc in procs.items():
        output = proc.communicate()[0]
        assert proc.returncode == 0, f"the recall_micro {attn} run failed:\n{output}"
    return runs
