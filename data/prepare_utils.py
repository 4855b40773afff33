"""Shared by every data/<name>/prepare.py: tokenize documents, write train.bin/val.bin/meta.json.

The on-disk format is nanoGPT's: each split is one flat array of token ids stored as raw uint16,
so training can read it with np.memmap(path, dtype=np.uint16, mode="r") without loading it.
meta.json records how the bins were made (tokenizer, vocab size, token and document counts).

    from data.prepare_utils import ensure_prepared, load_meta
    data_dir = ensure_prepared("stdlib")   # runs data/stdlib/prepare.py once, if its bins are missing
    meta = load_meta(data_dir)             # {"tokenizer": "byte", "vocab_size": 257, ...}
"""

import importlib
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common import atomic_write

DATA_ROOT = Path(__file__).resolve().parent


def tokenize(docs, tokenizer, append_eot=True, desc="tokenizing"):
    """Encode a list of documents into one flat uint16 array, each document followed by eot."""
    # uint16 halves the disk and memory of int32; it holds ids up to 65535 (GPT-2 needs 50256).
    assert tokenizer.vocab_size <= 2**16, f"vocab {tokenizer.vocab_size} does not fit in uint16"
    chunks = []
    for doc in tqdm(docs, desc=desc, unit="doc"):
        ids = tokenizer.encode(doc) + ([tokenizer.eot] if append_eot else [])
        chunks.append(np.array(ids, dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def write_dataset(out_dir, tokenizer, train_docs, val_docs, source, append_eot=True, **extra_meta):
    """Tokenize both splits and write out_dir/{train.bin, val.bin, meta.json}; return the meta dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot": tokenizer.eot,
            "dtype": "uint16", "source": source}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids = tokenize(docs, tokenizer, append_eot, desc=f"tokenizing {split}")
        # atomic: an interrupted run never leaves a truncated train.bin that a later run would
        # mistake for a finished one
        atomic_write(out_dir / f"{split}.bin", lambda f: f.write(ids.tobytes()))
        meta[f"{split}_tokens"] = len(ids)
        meta[f"{split}_docs"] = len(docs)
    meta.update(extra_meta)
    write_json_atomic(out_dir / "meta.json", meta)  # last: if it exists, the bins beside it are complete
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return meta


def write_json_atomic(path, obj):
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2) + "\n"), mode="w")


def load_meta(data_dir):
    """Read data_dir/meta.json as written by write_dataset."""
    return json.loads((Path(data_dir) / "meta.json").read_text())


def available_datasets():
    """Names of the folders in data/ that have a prepare.py."""
    return sorted(p.parent.name for p in DATA_ROOT.glob("*/prepare.py"))


def ensure_prepared(name):
    """Return data/<name>/ after running data/<name>/prepare.py's prepare() if its files are missing."""
    if name not in available_datasets():
        raise ValueError(f"unknown dataset {name!r}; choose one of {available_datasets()} "
                         "(each is a folder data/<name>/ with a prepare.py)")
    data_dir = DATA_ROOT / name
    if not (data_dir / "meta.json").exists():  # every prepare() writes meta.json last
        print(f"{data_dir} is not prepared yet; running data/{name}/prepare.py")
        importlib.import_module(f"data.{name}.prepare").prepare()
    return data_dir
