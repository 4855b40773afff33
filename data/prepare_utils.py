"""Pre-training data: every data/<name>/prepare.py writes train.bin/val.bin/meta.json with these
helpers, and train.py reads them back in random windows (PretrainBatches).

The on-disk format is nanoGPT's: each split is one flat array of token ids stored as raw uint16,
so training can read it with np.memmap(path, dtype=np.uint16, mode="r") without loading it; a
vocabulary of more than 65,536 ids (Llama 3 has 128,256) is stored as uint32. meta.json records
how the bins were made (tokenizer, vocab size, dtype, token and document counts).

    from data.prepare_utils import find_dataset, load_meta
    data_dir = find_dataset("stdlib")   # runs data/stdlib/prepare.py once, if its bins are missing
    meta = load_meta(data_dir)          # {"tokenizer": "byte", "vocab_size": 257, ...}
"""

import importlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

DATA_ROOT = Path(__file__).resolve().parent


def atomic_write(path, write, mode="wb"):
    """Call write(f) on a temporary file beside path, flush it to disk, then rename it over path.
    Readers see the old file or the new one, never half of one, even if the process dies mid-write.
    train.py writes its checkpoints and logs with it too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
    os.replace(tmp, path)


def token_dtype(vocab_size):
    """The dtype of the bins: uint16 halves the disk and memory of int32 and holds ids up to 65535
    (GPT-2 needs 50256); a larger vocabulary needs uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenize(docs, tokenizer, append_eot=True, desc="tokenizing"):
    """Encode a list of documents into one flat array (of token_dtype), each document followed by eot."""
    dtype = token_dtype(tokenizer.vocab_size)
    chunks = []
    for doc in tqdm(docs, desc=desc, unit="doc", disable=None):  # None: a bar on a terminal only
        ids = tokenizer.encode(doc) + ([tokenizer.eot] if append_eot else [])
        chunks.append(np.array(ids, dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def write_dataset(out_dir, tokenizer, train_docs, val_docs, source, append_eot=True, **extra_meta):
    """Tokenize both splits and write out_dir/{train.bin, val.bin, meta.json}; return the meta dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot": tokenizer.eot,
            "dtype": token_dtype(tokenizer.vocab_size), "source": source}
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


def find_dataset(name_or_path, prepare=True):
    """The dataset folder for --dataset: a folder path as given, or data/<name>/ (prepared on first
    use, unless prepare=False). A clear ValueError for anything else."""
    given = Path(name_or_path).expanduser()
    if os.sep in name_or_path or name_or_path.startswith((".", "~")) or given.is_dir():
        if not given.is_dir():
            raise ValueError(f"--dataset {name_or_path}: no such folder")
        return given
    if name_or_path not in available_datasets():
        raise ValueError(f"unknown dataset {name_or_path!r}: give a folder path, or one of {available_datasets()} "
                         "(each a folder data/<name>/ with a prepare.py)")
    try:
        return ensure_prepared(name_or_path) if prepare else DATA_ROOT / name_or_path
    except (ValueError, OSError, RuntimeError) as e:  # no source file, no network
        raise ValueError(f"preparing dataset {name_or_path!r} failed: {e}") from None


class PretrainBatches:
    """Windows of a folder's train.bin / val.bin: x, y (B, T) with y = x shifted by one. The ids
    are of meta.json's dtype (uint16 where it has none). Random windows (nanoGPT's), or with
    order="epoch" the split cut into disjoint windows, each drawn once per epoch, in an order
    seeded by seed and the epoch."""

    def __init__(self, data_dir, seq_len, device="cpu", order="random", seed=0):
        self.paths = {split: Path(data_dir) / f"{split}.bin" for split in ("train", "val")}
        self.seq_len, self.device, self.order, self.seed = seq_len, device, order, seed
        self.perm = (None, None)  # (epoch, its order of the windows)
        has_meta = (Path(data_dir) / "meta.json").is_file()
        self.dtype = np.dtype(load_meta(data_dir).get("dtype", "uint16") if has_meta else "uint16")
        for split, path in self.paths.items():
            if not path.is_file():
                hint = ("it holds SFT data (train.jsonl): add --task sft" if (Path(data_dir) / "train.jsonl").exists()
                        else "prepare it first (data/<name>/prepare.py writes train.bin and val.bin)")
                raise ValueError(f"{data_dir} has no {split}.bin for pre-training; {hint}")
            if len(np.memmap(path, dtype=self.dtype, mode="r")) <= seq_len + 1:
                raise ValueError(f"{path} has fewer than seq_len + 2 = {seq_len + 2} tokens; "
                                 "lower --seq_len or prepare more data")

    def get(self, split, batch_size, generator, first=None):
        """(x, y, t_out): x, y (batch_size, T); every position is an output position, t_out = T.
        first (order "epoch"): the batch is windows first, first + 1, ... of the run's order, which
        depends on nothing else: a resumed run, another split into micro-steps or another model
        gets the same windows."""
        data = np.memmap(self.paths[split], dtype=self.dtype, mode="r")  # a fresh memmap per batch, as nanoGPT
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
        epoch = k // n
        if self.perm[0] != epoch:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            self.perm = (epoch, order.tolist())
        return self.perm[1][k % n]


def to_device(batch, device):
    """A CPU batch onto device. On CUDA from pinned (page-locked) memory with non_blocking: the copy
    queues behind the work already queued and the CPU goes on at once, so train.py draws the next
    batch while the GPU still runs this step. (From pageable memory the copy would make the CPU wait.)"""
    if torch.device(device).type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)
