"""Tiny Shakespeare (1.1 MB of plays), GPT-2 BPE, the nanoGPT way.

    python data/shakespeare/prepare.py                    # downloads input.txt if missing
    python data/shakespeare/prepare.py --input PATH.txt   # offline: a local copy
    python data/shakespeare/prepare.py --input corpus.txt --tokenizer hf:DIR --out_dir data/corpus
        # any UTF-8 text, in a Hugging Face checkpoint's own tokenizer: data for its CPT

The first 90% of the characters are train, the last 10% val; the text is one document, with no
end token. GPT-2 BPE needs its ranks file: see data/tokenizer.py.
"""

import sys
import urllib.request
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import prepare_main, write_dataset
from data.tokenizer import get_tokenizer

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DEFAULT_INPUT = Path(__file__).resolve().parent / "input.txt"


def download(path):
    print(f"downloading {URL} to {path}")
    try:
        with urllib.request.urlopen(URL, timeout=30) as response:
            text = response.read()
    except OSError as e:  # URLError, timeouts and DNS failures are all OSErrors
        raise RuntimeError(f"could not download Tiny Shakespeare ({e}). Offline, place the file at "
                           f"{path} or pass --input PATH (prepare(input=...)).") from e
    path.write_bytes(text)


def prepare(input=None, out_dir=None, tokenizer="gpt2"):
    """Tiny Shakespeare (downloaded if missing), or another text, in the tokenizer of that name."""
    input_path = Path(input or DEFAULT_INPUT)
    if not input_path.exists():
        if input_path != DEFAULT_INPUT:
            raise FileNotFoundError(f"no such input file: {input_path}")
        download(input_path)
    text = input_path.read_text(encoding="utf-8")
    n_train = int(0.9 * len(text))  # split by characters before encoding, as nanoGPT does
    source = f"Tiny Shakespeare ({URL}), read from {input_path}" \
        if input_path == DEFAULT_INPUT else str(input_path)
    return write_dataset(out_dir or DEFAULT_INPUT.parent, get_tokenizer(tokenizer),
                         [text[:n_train]], [text[n_train:]], append_eot=False,
                         source=source + "; first 90% of characters train, last 10% val")


if __name__ == "__main__":
    prepare_main(prepare, __doc__)
