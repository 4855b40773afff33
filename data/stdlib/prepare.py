"""The default corpus: the Python standard library's own source code, as UTF-8 bytes. No download.

    python data/stdlib/prepare.py                   # writes data/stdlib/{train.bin, val.bin, meta.json}
    python data/stdlib/prepare.py --max_files 50    # a quick small version
    python data/stdlib/prepare.py --src_dir DIR --tokenizer hf:CKPT --out_dir data/code   # for a checkpoint's CPT

Every .py file under sysconfig's stdlib folder except tests (they would
more than double the corpus with code that exercises the library rather than implements it),
installed third-party packages and generated data (see EXCLUDED_DIRS). Each file is one document,
followed by the tokenizer's end token. Train and val are split by file, not by position,
so no val file has been seen, even in part, during training.
"""

import argparse
import hashlib
import sys
import sysconfig
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import write_dataset
from data.tokenizer import get_tokenizer

# Tests, third-party packages, and two folders of generated data rather than code: pydoc_data
# (0.8 MB of help text in one file, which would be most of val) and encodings (codec tables).
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "encodings"}


def find_files(src_dir):
    """All .py files under src_dir outside EXCLUDED_DIRS, sorted by their path relative to src_dir."""
    files = [p.relative_to(src_dir) for p in Path(src_dir).rglob("*.py")]
    return sorted(p for p in files if not EXCLUDED_DIRS & set(p.parts))


def is_val(rel_path, val_fraction):
    """Assign a file to val by a stable hash of its relative path."""
    # NOTE: not Python's hash(), which is salted per process. A hash of the path (not the
    # file's rank in the sorted list) keeps every other file's split when files come or go.
    h = hashlib.sha256(rel_path.as_posix().encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < val_fraction


def prepare(src_dir=None, out_dir=None, max_files=None, val_fraction=0.1, tokenizer="byte"):
    """Tokenize the .py files under src_dir (default: this Python's stdlib) into out_dir, with the
    tokenizer of that name (data/tokenizer.py: byte, gpt2 or hf:DIR)."""
    what = f"Python {sys.version.split()[0]} standard library" if src_dir is None else "the"
    src_dir = Path(src_dir or sysconfig.get_paths()["stdlib"])
    out_dir = Path(out_dir or Path(__file__).resolve().parent)
    files = find_files(src_dir)
    splits = {"train": [], "val": []}
    for rel in files:
        splits["val" if is_val(rel, val_fraction) else "train"].append(rel)
    if max_files:
        # Cap each split in proportion rather than the file list as a whole: the first 50 files
        # alone may well hold no val file at all.
        n_val = max(1, round(max_files * val_fraction))
        splits = {"train": splits["train"][:max_files - n_val], "val": splits["val"][:n_val]}
    if not splits["train"] or not splits["val"]:
        raise ValueError(f"{len(files)} files under {src_dir} gave an empty split "
                         f"(train {len(splits['train'])}, val {len(splits['val'])}); "
                         "use more files or change val_fraction")

    def read(rel):
        # errors="replace": a stray non-UTF-8 file should cost a few characters, not the whole run.
        return (src_dir / rel).read_text(encoding="utf-8", errors="replace")

    return write_dataset(
        out_dir, get_tokenizer(tokenizer),
        train_docs=[read(rel) for rel in splits["train"]],
        val_docs=[read(rel) for rel in splits["val"]],
        source=f"{what} .py files under {src_dir}, "
               f"excluding {sorted(EXCLUDED_DIRS)}; one document per file; split by sha256 of the path",
        val_fraction=val_fraction,
        val_files=[rel.as_posix() for rel in splits["val"]],
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src_dir", help="folder of .py files (default: this Python's standard library)")
    parser.add_argument("--out_dir", help="where to write the bins (default: data/stdlib/)")
    parser.add_argument("--max_files", type=int, help="use only N files, the first by path from each split")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--tokenizer", default="byte", help="byte (default), gpt2, or hf:DIR (a checkpoint's tokenizer.json)")
    args = parser.parse_args()
    t0 = time.time()
    try:
        meta = prepare(args.src_dir, args.out_dir, args.max_files, args.val_fraction, args.tokenizer)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # a bad --tokenizer or --src_dir: one line
        sys.exit(f"error: {e}")
    print(f"{meta['train_docs']} train files, {meta['val_docs']} val files, {time.time() - t0:.1f} s")
