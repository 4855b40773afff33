"""
Checkpoints: the one place that writes and reads them, for train.py and sample.py.

A checkpoint is a dict of tensors and plain Python values (numbers, strings, lists, dicts), so
it loads with torch.load(..., weights_only=True): opening a checkpoint file cannot run code.
It is written atomically (a temp file, then a rename), so a crash or a kill in the middle of
a save leaves the previous checkpoint whole.
"""

import os
from pathlib import Path

import torch

from orthros import Orthros, OrthrosConfig

FORMAT = "orthros-checkpoint-v1"  # marks our files; anything else is refused with a clear error


def save_checkpoint(path, **state):
    """Write state (model, optimizer, step, config, ...) to path, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint
    os.replace(tmp, path)     # atomic: readers see the old file or the new one, never half of one


def load_checkpoint(path, device="cpu"):
    """Read a checkpoint written by save_checkpoint, with clear errors for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (python train.py --config tiny) "
                                "or pass the right --ckpt / --out_dir")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a loadable checkpoint: it is corrupt, truncated, or not a "
                         f"plain-tensor file ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path} is a torch file but not an orthros checkpoint (no '{FORMAT}' marker); "
                         "only checkpoints written by this repo's train.py can be loaded")
    return ckpt


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
        raise FileNotFoundError(f"no checkpoint (*.pt) under {out_dir}/: train one first, e.g. "
                                "python train.py --config tiny, or pass --ckpt PATH")
    return max(found, key=lambda p: p.stat().st_mtime)
