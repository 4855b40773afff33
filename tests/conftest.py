"""Shared pytest fixtures for the tests in this folder."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `pytest tests/` from anywhere: import from the repository root


@pytest.fixture(scope="session")
def recall_tiny_runs(tmp_path_factory):
    """recall_tiny trained once per test session, for Orthros and SWA (about 7 minutes on 2 idle CPU
    cores): {attn: out_dir}. test_train.py's recall test and exercise 10's check both read them."""
    import train
    root = tmp_path_factory.mktemp("recall_tiny")
    for attn in ("orthros", "swa"):
        train.main(["--config", "recall_tiny", "--attn", attn, "--device", "cpu", "--eval_iters", "1",
                    "--out_dir", str(root / attn)])
    return {attn: root / attn for attn in ("orthros", "swa")}
