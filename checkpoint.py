"""
Checkpoints: the one place that writes and reads them, for train.py and sample.py.

A checkpoint is a dict of tensors and plain Python values (numbers, strings, lists, dicts), so
it loads with torch.load(..., weights_only=True): opening a checkpoint file cannot run code.
It is written atomically (a temp file, then a rename), so a crash or a kill in the middle of
a save leaves the previous checkpoint whole.
"""

import re
from pathlib import Path

import torch

from common import atomic_write
from orthros import Orthros, OrthrosConfig

FORMAT = "orthros-checkpoint-v1"  # marks our files; anything else is refused with a clear error


def save_checkpoint(path, **state):
    """Write state (model, optimizer, step, config, ...) to path, atomically."""
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f))


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint written by save_checkpoint, with clear errors for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a loadable checkpoint: {_why_unloadable(e, path)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is a torch file but not an orthros checkpoint (no '{FORMAT}' marker); "
                         "only checkpoints written by this repo's train.py can be loaded")
    return ckpt


def _why_unloadable(e, path):
    """torch.load's error, said in one sentence (its own messages run to several paragraphs)."""
    message = str(e)
    if "Unsupported global" in message:
        found = re.search(r"GLOBAL ([\w.]+)", message)
        return (f"it holds a Python object ({found[1] if found else 'a class'}) rather than plain tensors and "
                "values, and weights_only loading refuses those so that opening a file cannot run code.")
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    if is_zip or "zip archive" in message or "central directory" in message:
        return "the file is truncated or corrupt (it is not a complete torch zip archive)."
    if isinstance(e, torch.serialization.pickle.UnpicklingError) or "Weights only load failed" in message:
        return "it is not a torch checkpoint (its bytes do not unpickle as one)."
    first = message.strip().splitlines()[0] if message.strip() else ""
    return f"torch.load failed with {type(e).__name__}" + (f": {first}" if len(first) <= 200 else "") + "."


def model_from_checkpoint(ckpt, **config_overrides):
    """Build the model a checkpoint describes and load its weights. config_overrides may change
    fields that do not touch the weights, e.g. max_seq_len for longer generation."""
    config = OrthrosConfig(**{**ckpt["model_config"], **config_overrides})
    model = Orthros(config)
    model.load_state_dict(ckpt["model"])
    return model


def find_latest_checkpoint(out_dir):
    """The most recently written checkpoint (*.pt) under out_dir, searching subfolders too."""
    found = [p for p in Path(out_dir).rglob("*.pt") if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no checkpoint (*.pt) under {out_dir}/: train one first "
                                "(python train.py --config tiny), or pass --ckpt PATH")
    return max(found, key=lambda p: p.stat().st_mtime)
