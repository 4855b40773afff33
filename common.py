"""
Small helpers shared by the scripts (train.py, sample.py, bench.py, experiments.py), by
checkpoint.py and by data/: one copy of each. Imports nothing of ours.

    device = pick_device("auto")        # cuda, else mps, else cpu; a clear error for a device that is absent
    sync(device)                        # wait for the GPU, so a timer measures the work, not the launches
    atomic_write(path, lambda f: f.write(data))   # temp file, fsync, rename: never half a file
    meta = run_meta(device)             # date, device, torch, git commit and whether the tree was clean
    parser = ArgumentParser(...)        # argparse whose errors are one line: "error: --top_k must be >= 1"
"""

import argparse
import datetime
import os
import re
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent


def pick_device(name="auto"):
    """'auto' -> 'cuda' if a CUDA GPU is usable, else 'mps' (Apple silicon), else 'cpu'. An explicit
    name is checked, so a missing GPU is one clear error rather than a traceback from deep in torch."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind = name.split(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for, but this torch has no usable CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu (or auto)")
        index = int(name.split(":")[1]) if ":" in name and name.split(":")[1].isdigit() else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif kind == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device {name!r} was asked for, but MPS is not available here; use --device cpu")
    elif name != "cpu":
        raise ValueError(f"unknown device {name!r}: choose auto, cpu, cuda, cuda:N or mps")
    return name


def sync(device):
    """Block until the device has finished its queued work (a no-op on CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def atomic_write(path, write, mode="wb"):
    """Call write(f) on a temporary file beside path, flush it to disk, then rename it over path.
    Readers see the old file or the new one, never half of one, even if the process dies mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
    os.replace(tmp, path)


def git_state():
    """(commit, clean): the checked-out commit and whether the tracked files have no uncommitted
    changes. The environment variables ORTHROS_GIT_COMMIT and ORTHROS_GIT_CLEAN (1 or 0), where
    set, say it instead: for a copy of the tree that has no .git of its own, or a stale one (as on
    a machine the tree was sent to). Without either, (None, None)."""
    if os.environ.get("ORTHROS_GIT_COMMIT"):
        clean = os.environ.get("ORTHROS_GIT_CLEAN")
        return os.environ["ORTHROS_GIT_COMMIT"], (clean == "1") if clean in ("0", "1") else None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if commit:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
            return commit, status == ""
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def run_meta(device="cpu"):
    """What a result file records about where it was measured."""
    device = torch.device(device)
    commit, clean = git_state()
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": commit, "git_clean": clean}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line stops with one line ("error: --lr takes a float, got 'x'")
    instead of the usage block; --help still shows everything."""

    def error(self, message):
        message = re.sub(r"^argument (--\w+)(/-\w+)?: ", r"\1 ", message)
        raise SystemExit(f"error: {message}; {self.prog} --help lists every option")
