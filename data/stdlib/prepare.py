"""The default corpus: the Python standard library's own source code, as UTF-8 bytes. No download.

    python data/stdlib/prepare.py                  # data/stdlib/{train.bin, val.bin, meta.json}
    python data/stdlib/prepare.py --max_files 50   # a quick small version
    python data/stdlib/prepare.py --src_dir DIR --tokenizer hf:CKPT --out_dir data/code   # for CPT

Every .py file under sysconfig's stdlib folder but tests (twice the library's size), installed
packages and generated data (EXCLUDED_DIRS), one document each, split into train and val by file:
no val file is seen in training, even in part.
"""

import sys
import sysconfig
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import hashed, prepare_main, write_dataset
from data.tokenizer import get_tokenizer

# pydoc_data: 0.8 MB of help text in one file, which would be most of val; encodings: codec tables
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data",
                 "encodings"}


def find_files(src_dir):
    """The .py files under src_dir outside EXCLUDED_DIRS, relative to it, sorted."""
    files = [p.relative_to(src_dir) for p in Path(src_dir).rglob("*.py")]
    return sorted(p for p in files if not EXCLUDED_DIRS & set(p.parts))


def is_val(rel_path, val_fraction):  # by the path's hash: a file that comes or goes moves no other
    return hashed(rel_path.as_posix()) < val_fraction


def prepare(src_dir=None, out_dir=None, max_files=None, val_fraction=0.1, tokenizer="byte"):
    """The .py files under src_dir (default: this Python's stdlib) into out_dir."""
    what = f"Python {sys.version.split()[0]} standard library" if src_dir is None else "the"
    src_dir = Path(src_dir or sysconfig.get_paths()["stdlib"])
    files = find_files(src_dir)
    val = [rel for rel in files if is_val(rel, val_fraction)]
    train = [rel for rel in files if not is_val(rel, val_fraction)]
    if max_files:  # from each split in proportion: the first 50 files may hold no val file
        n_val = max(1, round(max_files * val_fraction))
        train, val = train[:max_files - n_val], val[:n_val]
    if not train or not val:
        raise ValueError(f"{len(files)} files under {src_dir} gave an empty split (train "
                         f"{len(train)}, val {len(val)}); use more files or change val_fraction")
    # errors="replace": a stray non-UTF-8 file costs a few characters, not the run
    read = lambda rel: (src_dir / rel).read_text(encoding="utf-8", errors="replace")
    return write_dataset(out_dir or Path(__file__).resolve().parent, get_tokenizer(tokenizer),
        [read(rel) for rel in train], [read(rel) for rel in val],
        source=f"{what} .py files under {src_dir}, excluding {sorted(EXCLUDED_DIRS)}; one "
               "document per file; split by sha256 of the path",
        val_fraction=val_fraction, val_files=[rel.as_posix() for rel in val])


if __name__ == "__main__":
    prepare_main(prepare, __doc__, max_files=int)
