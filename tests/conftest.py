"""Shared pytest fixtures for the tests in this folder."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RECALL = {}   # attn -> (out_dir, its training process), once a test of the session reads the runs
THREADS = {}  # the torch threads and OMP_NUM_THREADS to restore once the recall runs are done


def pytest_collection_finish(session):
    """The recall_micro trainings (SWA and Orthros, about 20 s each on one CPU thread) start as
    soon as the session knows that a test reads them, and run beside the tests before it at the
    lowest priority (nice 19). recall_runs waits for them."""
    if not any("recall_runs" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    # NOTE: meanwhile the tests, and the processes they start, run one torch thread: two threads
    # that meet at every op wait for a core the trainings hold (a 2-core step ran 20x slower).
    import torch
    THREADS.update(torch=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    from data.prepare_utils import find_dataset
    find_dataset("recall_micro")  # prepared once, before the two processes read it
    root = Path(tempfile.mkdtemp(prefix="orthros-recall-"))
    for attn in ("swa", "orthros"):
        with open(root / f"{attn}.log", "w") as log:
            RECALL[attn] = root / attn, subprocess.Popen(
                [sys.executable, "train.py", "--config", "recall_micro", "--attn", attn, "--device",
                 "cpu", "--out_dir", str(root / attn)], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))


def pytest_sessionfinish(session):
    for out, proc in RECALL.values():
        proc.kill()   # a session stopped early (-x, Ctrl-C) leaves no training behind
        proc.wait()
        shutil.rmtree(out.parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test starts with the session's torch thread count (sample.main may lower it), all of
    them again once the recall runs are done."""
    import torch
    if THREADS and all(proc.poll() is not None for _, proc in RECALL.values()):
        torch.set_num_threads(THREADS.pop("torch"))
        omp = THREADS.pop("omp")
        os.environ.pop("OMP_NUM_THREADS")
        os.environ.update({} if omp is None else {"OMP_NUM_THREADS": omp})
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def recall_runs():
    """recall_micro trained once per session, for SWA and Orthros: {attn: out_dir}."""
    for attn, (out, proc) in RECALL.items():
        log = (out.parent / f"{attn}.log").read_text
        assert proc.wait() == 0, f"the recall_micro {attn} run failed:\n{log()}"
    return {attn: out for attn, (out, _) in RECALL.items()}
