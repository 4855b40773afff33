"""Pre-training data, nanoGPT's format: each data/<name>/prepare.py writes train.bin and val.bin
(flat token ids, uint16, or uint32 above 65,536 ids) and meta.json (how they were made) with
write_dataset; train.py reads random windows of them through np.memmap (PretrainBatches)."""

import argparse
import hashlib
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

DATA_ROOT = Path(__file__).resolve().parent


def atomic_write(path, write, mode="wb"):
    """write(f) to a file beside path, then renamed over it: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
    os.replace(tmp, path)


def hashed(name):
    """A stable number in [0, 1) for a document's name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def write_json_atomic(path, obj):
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2) + "\n"), mode="w")


def write_dataset(out_dir, tokenizer, train_docs, val_docs, source, append_eot=True, **extra_meta):
    """Both splits' documents, each followed by eot, into out_dir/{train,val}.bin; meta.json."""
    dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"  # half of int32's bytes
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot": tokenizer.eot,
            "dtype": dtype, "source": source}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        chunks = [np.array(tokenizer.encode(doc) + [tokenizer.eot] * append_eot, dtype=dtype)
                  for doc in tqdm(docs, desc=f"tokenizing {split}", unit="doc", disable=None)]
        ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        atomic_write(Path(out_dir) / f"{split}.bin", lambda f: f.write(ids.tobytes()))
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = len(ids), len(docs)
    meta.update(extra_meta)
    write_json_atomic(Path(out_dir) / "meta.json", meta)  # last: if there, the bins are whole
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return meta


def prepare_main(prepare, doc, **types):
    """--KEY for each of prepare's keywords (typed as its default) and of types; errors: a line."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    keys = {k: p.default for k, p in inspect.signature(prepare).parameters.items()
            if p.default is not p.empty}
    for key, default in {**keys, **dict.fromkeys(k for k in types if k not in keys)}.items():
        kind = types.get(key, str if default is None else type(default))
        parser.add_argument(f"--{key}", type=kind, default=default,
                            help=None if default is None else f"default {default}")
    try:
        prepare(**{k: v for k, v in vars(parser.parse_args()).items() if v is not None})
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {e}")


def load_meta(data_dir):
    return json.loads((Path(data_dir) / "meta.json").read_text())


def ensure_prepared(name, prepare=True):
    """data/<name>/, after running its prepare.py's prepare() if its meta.json is missing;
    recall_<preset>: data/recall/prepare.py's preset."""
    module, preset = ("recall", [name[7:]]) if name.startswith("recall_") else (name, [])
    known = sorted(p.parent.name for p in DATA_ROOT.glob("*/prepare.py"))
    if module not in known or preset == ["default"]:
        raise ValueError(f"unknown dataset {name!r}: give a folder path, or one of {known} (each a "
                         "folder data/<name>/ with a prepare.py), or recall_<preset>")
    if prepare and not (DATA_ROOT / name / "meta.json").exists():  # prepare() writes it last
        print(f"{DATA_ROOT / name} is not prepared yet; running data/{module}/prepare.py")
        try:
            importlib.import_module(f"data.{module}.prepare").prepare(*preset)
        except (ValueError, OSError, RuntimeError) as e:  # no source file, no network
            raise ValueError(f"preparing dataset {name!r} failed: {e}") from None
    return DATA_ROOT / name


def find_dataset(name_or_path, prepare=True):
    """--dataset's folder: a path as given, or data/<name>/ (prepared on first use)."""
    given = Path(name_or_path).expanduser()
    if os.sep in name_or_path or name_or_path.startswith((".", "~")) or given.is_dir():
        if not given.is_dir():
            raise ValueError(f"--dataset {name_or_path}: no such folder")
        return given
    return ensure_prepared(name_or_path, prepare)


class PretrainBatches:
    """x, y (B, T) windows of train.bin / val.bin, y = x shifted by one: random or order="epoch"."""

    def __init__(self, data_dir, seq_len, device="cpu", order="random", seed=0):
        self.paths = {split: Path(data_dir) / f"{split}.bin" for split in ("train", "val")}
        self.seq_len, self.device, self.order, self.seed = seq_len, device, order, seed
        self.perm = (None, None)  # (epoch, its order of the windows)
        has_meta = (Path(data_dir) / "meta.json").is_file()
        self.dtype = np.dtype(load_meta(data_dir).get("dtype", "uint16") if has_meta else "uint16")
        for split, path in self.paths.items():
            if not path.is_file():
                hint = ("it holds SFT data (train.jsonl): add --task sft" if (Path(data_dir) /
                        "train.jsonl").exists() else "prepare it first (data/<name>/prepare.py)")
                raise ValueError(f"{data_dir} has no {split}.bin for pre-training; {hint}")
            if len(np.memmap(path, dtype=self.dtype, mode="r")) <= seq_len + 1:
                raise ValueError(f"{path} has fewer than seq_len + 2 = {seq_len + 2} tokens; "
                                 "lower --seq_len or prepare more data")

    def get(self, split, batch_size, generator, first=None):
        """(x, y, t_out = T); order "epoch": windows first, first + 1, ... however split."""
        data = np.memmap(self.paths[split], dtype=self.dtype, mode="r")  # anew, as nanoGPT
        T = self.seq_len
        if self.order == "epoch" and first is not None:
            n = (len(data) - 1) // T  # window i: data[i T : (i + 1) T + 1]
            ix = [T * self.window(k, n) for k in range(first, first + batch_size)]
        else:
            ix = torch.randint(len(data) - T - 1, (batch_size,), generator=generator).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return to_device(x, self.device), to_device(y, self.device), T

    def window(self, k, n):
        """The k-th window drawn of n: epoch k // n draws all n, in its own shuffled order."""
        if self.perm[0] != k // n:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + k // n))
            self.perm = (k // n, order.tolist())
        return self.perm[1][k % n]


def to_device(batch, device):
    """A CPU batch onto device; on CUDA pinned, non_blocking: train.py draws the next meanwhile."""
    if torch.device(device).type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)
