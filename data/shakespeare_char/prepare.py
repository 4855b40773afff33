"""Tiny Shakespeare at character level: the data of nanoGPT's shakespeare_char benchmark.

    python data/shakespeare_char/prepare.py                   # data/shakespeare/input.txt
    python data/shakespeare_char/prepare.py --input PATH.txt  # offline: a local copy

The text is ASCII, so the byte tokenizer gives one id per character: nanoGPT's 65 characters, in
the same order, in a vocabulary of 257. The first 90% of the characters are train, as in nanoGPT.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import prepare_main
from data.shakespeare.prepare import DEFAULT_INPUT, download
from data.shakespeare.prepare import prepare as prepare_text


def prepare(input=None, out_dir=None):
    """Byte-level bins of Tiny Shakespeare (or another ASCII text) in out_dir (default: here)."""
    input_path = Path(input or DEFAULT_INPUT)
    if input_path == DEFAULT_INPUT and not input_path.exists():
        download(input_path)
    if not input_path.read_bytes().isascii():
        raise ValueError(f"{input_path} is not ASCII, so its bytes are not its characters; "
                         "use data/shakespeare/prepare.py --tokenizer byte for a byte-level corpus")
    return prepare_text(input_path, out_dir or Path(__file__).resolve().parent, tokenizer="byte")


if __name__ == "__main__":
    prepare_main(prepare, __doc__)
