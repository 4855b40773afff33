"""
Checkpoints: the one home of their format. train.py writes them, sample.py, perf/, repro/ and
the exercises read them, all through this file.

    from checkpoint import save_checkpoint, load_checkpoint, model_from_checkpoint
    save_checkpoint("out/run/ckpt_last.pt", model=model.state_dict(), model_config=..., step=...)
    ckpt = load_checkpoint("out/run/ckpt_last.pt")  # a dict; weights_only: opening it runs no code
    model = model_from_checkpoint(ckpt)             # orthros.Orthros with the checkpoint's weights
    ckpt = load_checkpoint("hf:models/SmolLM2-135M")  # a Hugging Face folder, via convert/hf.py

A checkpoint is a dict saved by torch.save, holding only tensors and plain values:
    format        "orthros-checkpoint-v1" (anything else is refused)
    model         the model's state_dict
    model_config  the OrthrosConfig fields, as a dict
    step          optimizer steps taken
    and, from train.py: optimizer (its state keyed by parameter name), best_val_loss, train_config,
    config_name, tokenizer, tokenizer_files (an hf: tokenizer's own files, {name: text}, or None),
    dataset, rng (training_state and restore_training_state).

Also here: the rules of a run's folder (a run never writes over another run's files; Ctrl-C stops
it saved; how to resume it), and, because train.py and sample.py both need them and no script
imports another, the device (pick_device, cpu_threads, sync, compile_works), the command line
(ArgumentParser's one-line errors; options generated from a config dataclass, with help and check)
and what a result file records about where it was measured (run_meta).
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import unittest.mock
from dataclasses import asdict, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from data.prepare_utils import atomic_write
from orthros import Orthros, OrthrosConfig, identity_scale_offset

CKPT_FORMAT = "orthros-checkpoint-v1"
REPO = Path(__file__).resolve().parent


def save_checkpoint(path, **state):
    """Write state (tensors and plain values, so that weights_only loading reads it) atomically:
    a temp file, then a rename, so a crash mid-save leaves the previous checkpoint whole."""
    atomic_write(path, lambda f: torch.save({"format": CKPT_FORMAT, **state}, f))


def load_checkpoint(path, device="cpu", mmap=False):
    """Read a checkpoint that save_checkpoint wrote. weights_only=True: opening a file cannot run
    code; mmap=True leaves the tensors on disk until read. "hf:DIR" converts the Hugging Face
    checkpoint in folder DIR instead, with window 128 (convert/hf.py)."""
    if str(path).startswith("hf:"):
        from convert.hf import convert_hf  # needs safetensors and tokenizers: imported only for hf:
        folder = Path(str(path)[3:]).expanduser().resolve()
        model_config, state_dict = convert_hf(folder, device=device)
        return {"format": CKPT_FORMAT, "model": state_dict, "model_config": model_config, "step": 0,
                "tokenizer": f"hf:{folder}", "source": f"hf:{folder}"}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as e:  # torch's own messages run to paragraphs: say why in one sentence
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch.save(model), not a state dict
        why = (f"it holds a Python object ({found[1]}), which weights_only loading refuses so that "
               "opening a file cannot run code; save a state dict (torch.save(model.state_dict(), "
               "...)) or train.py's checkpoint" if found
               else "the file is truncated or corrupt (it is not a complete torch zip archive)."
               if is_zip else "it is not a torch checkpoint (its bytes do not unpickle as one).")
        raise ValueError(f"{path} is not a loadable checkpoint: {why}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ValueError(f"{path} is a torch file but not an orthros checkpoint (no "
                         f"'{CKPT_FORMAT}' marker); only checkpoints written by this repo's "
                         "train.py can be loaded")
    return ckpt


def load_start(init_from, out_dir, mmap=False):
    """The checkpoint a training run starts from: None ("scratch"), out_dir/ckpt_last.pt ("resume"),
    or the file init_from names. Raises ValueError with what to do when there is none."""
    if init_from == "scratch":
        return None
    path = Path(out_dir) / "ckpt_last.pt" if init_from == "resume" else init_from  # or hf:DIR
    try:
        return load_checkpoint(path, mmap=mmap)
    except (FileNotFoundError, ValueError) as e:
        hint = (". Check --out_dir (or --config and --attn, which set the default out_dir); a run "
                "saves ckpt_last.pt at every eval and on Ctrl-C") if init_from == "resume" else ""
        raise ValueError(f"--init_from {init_from}: {e}{hint}") from None


def model_from_checkpoint(ckpt, **config_overrides):
    """The model a checkpoint describes, with its weights, in their dtype. config_overrides may
    change fields that do not touch the weights: max_seq_len for longer generation, the window, or
    attn (the paper's conversion: a Transformer's weights as Orthros with identity scale-offsets,
    or an Orthros whose scale-offsets are still the identity, e.g. a converted model, as its
    Transformer or SWA baseline)."""
    # On "meta": no memory, no init for weights about to be replaced (8B: 32 GB). NOTE: normal_ is
    # skipped: torch's first normal_ on "meta" imports torch._dynamo, seconds of sample.py's start.
    with torch.device("meta"), unittest.mock.patch("torch.nn.init.normal_", lambda t, *a, **k: t):
        model = Orthros(OrthrosConfig(**{**ckpt["model_config"], **config_overrides}))
    own, state = model.state_dict(), dict(ckpt["model"])
    like = state["wte.weight"]
    for name in own.keys() - state.keys():  # scale-offsets the checkpoint lacks (a Transformer's)
        if (identity := identity_scale_offset(name)) is not None:
            state[name] = torch.full_like(own[name], identity, device=like.device, dtype=like.dtype)
    for name in state.keys() - own.keys():  # scale-offsets a baseline lacks: only identities go
        identity = identity_scale_offset(name)
        if identity is not None and (state.pop(name) != identity).any():
            raise ValueError(f"{name} is trained (not the identity): this Orthros has no "
                             f"{model.config.attn} baseline")
    model.load_state_dict(state, assign=True)  # the checkpoint's own tensors, in their dtype
    if model.config.tie_embeddings:
        model.lm_head.weight = model.wte.weight  # assign=True loaded the two names as two tensors
    return model


def training_state(model, optimizer=None, data_rng=None):
    """What resuming needs besides the step: the model's and the optimizer's full states, on the
    CPU, the optimizer's keyed by parameter name (whatever the number of processes and the
    sharding: under FSDP every rank gathers its shards, and rank 0 writes them), and the random
    states (the batches' generator, torch's, CUDA's). restore_training_state puts them back.
    Without an optimizer: the weights alone."""
    from torch.distributed.checkpoint import state_dict as dcp
    full = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": dcp.get_model_state_dict(model, options=full)}
    if optimizer is None:
        return state
    cuda = {"cuda": torch.cuda.get_rng_state()} if next(model.parameters()).is_cuda else {}
    return {**state, "optimizer": dcp.get_optimizer_state_dict(model, optimizer, options=full),
            "rng": {"data": data_rng.get_state(), "torch": torch.get_rng_state(), **cuda}}


def restore_training_state(ckpt, model, optimizer, data_rng, sharded=False):
    """Resume from a checkpoint: its optimizer state into optimizer (whose model may be sharded:
    FSDP), and its random states. (The weights are loaded when the model is built, unsharded.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, ckpt["optimizer"],
                             options=StateDictOptions(full_state_dict=sharded))
    data_rng.set_state(ckpt["rng"]["data"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if "cuda" in ckpt["rng"] and next(model.parameters()).is_cuda:
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])


def find_latest_checkpoint(out_dir):
    """The most recently written checkpoint (*.pt) under out_dir, searching subfolders too."""
    found = [p for p in Path(out_dir).rglob("*.pt") if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no checkpoint (*.pt) under {out_dir}/: train one first "
                                "(python train.py --config tiny), or pass --ckpt PATH")
    return max(found, key=lambda p: p.stat().st_mtime)


# -----------------------------------------------------------------------------
# A run's folder (train.py's out_dir): a run never writes over another run's files; it stops
# after a whole step, saved, and says how to resume

RUN_FILES = ("log.jsonl", "ckpt_last.pt", "ckpt_best.pt", "exact_match.json")  # what a run writes


def claim_out_dir(out_dir, init_from, overwrite):
    """Before a run writes anything: out_dir holds no other run (unless it resumes it, or overwrite)
    and not the checkpoint it starts from. Raises ValueError saying what to do instead."""
    out_dir = Path(out_dir)
    start = Path(init_from.removeprefix("hf:")).resolve()
    if init_from not in ("scratch", "resume") and out_dir.resolve() in start.parents:
        raise ValueError(f"--init_from {init_from} lies in --out_dir {out_dir}: this run would "
                         "write over the run it starts from. Give it its own --out_dir")
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if present and init_from != "resume" and not overwrite:
        raise ValueError(f"{out_dir} already holds a run ({', '.join(present)}). Continue it "
                         "with --init_from resume, start a new one with --out_dir NEW_DIR, or "
                         "replace it with --overwrite true")


def link_best(out_dir):
    """Make out_dir's ckpt_best.pt the file ckpt_last.pt is, without writing it again: a hard link
    (a copy where the file system has none), renamed into place, so atomic as every save. NOTE:
    this needs save_checkpoint never to write into a file (it writes a temp file, then renames it):
    the next ckpt_last.pt is then a new file, and ckpt_best.pt keeps these bytes."""
    out_dir = Path(out_dir)
    tmp = out_dir / "ckpt_best.pt.tmp"
    tmp.unlink(missing_ok=True)  # left by a crash
    try:
        os.link(out_dir / "ckpt_last.pt", tmp)
    except OSError:
        shutil.copyfile(out_dir / "ckpt_last.pt", tmp)
    os.replace(tmp, out_dir / "ckpt_best.pt")


class StopRequest:
    """While a run writes: SIGINT (Ctrl-C) and SIGTERM ask its loop to stop after the current step
    (under torchrun, at the next log step) and save ckpt_last.pt. A second Ctrl-C stops at once
    (KeyboardInterrupt), unsaved; a repeated SIGTERM just waits. Outside it, Ctrl-C ends the run
    the way Python does."""

    def __enter__(self):
        self.asked = self.signal = None  # asked: on this process; signal: agreed on, at a read
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.asked is None:
            self.asked = signal.Signals(signum).name
            tqdm.write(f"{self.asked}: stopping after this step (torchrun: the next log step) and "
                       "saving; Ctrl-C again: at once, unsaved")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt


def resume_command(argv):
    """The command line that continues this run: the same options, with --init_from resume, quoted
    for the shell (an empty value, --curriculum "", or one with spaces, survives copy and paste)."""
    kept, drop_value = [], False
    for arg in argv:
        if drop_value:
            drop_value = False
        elif arg.split("=")[0] in ("--init_from", "--overwrite"):
            drop_value = "=" not in arg  # --key value, not --key=value
        else:
            kept.append(arg)
    return shlex.join(["python", "train.py", *kept, "--init_from", "resume"])


def resumed(cfg, given):
    """--init_from resume: (its config name, the config the run saved in out_dir/ckpt_last.pt, with
    the options given on this command line over it); a note names those that change it."""
    try:
        ckpt = load_start("resume", cfg.out_dir, mmap=True)  # mmap: the config, not the weights
    except ValueError as e:
        fail(str(e))
    names = {f.name for f in fields(cfg)}
    saved = {k: v for k, v in ckpt.get("train_config", {}).items() if k in names}
    changed = [f"--{k} {v} (was {saved[k]!r})" for k, v in given.items()
               if k not in ("init_from", "out_dir", "overwrite") and v != saved.get(k, v)]
    if changed:
        note(f"resuming {cfg.out_dir}/ckpt_last.pt with its run's options, but "
             + ", ".join(changed))
    this_run = {"out_dir": cfg.out_dir, "overwrite": cfg.overwrite, "init_from": "resume"}
    return ckpt.get("config_name"), type(cfg)(**{**asdict(cfg), **saved, **given, **this_run})


def open_log(out_dir, resume, overwrite, start_step):
    """out_dir/log.jsonl for appending. A resumed run first drops the records after its checkpoint's
    step (they are about to be redone); overwrite first deletes the previous run's files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "log.jsonl"
    if resume and path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= start_step]
        atomic_write(path, lambda f: f.write("".join(kept)), mode="w")
    elif overwrite:
        for old in [*(out_dir / name for name in RUN_FILES), *out_dir.glob("ckpt_[0-9]*.pt")]:
            old.unlink(missing_ok=True)  # ckpt_<step>.pt: --keep_steps'
    return open(path, "a")


# -----------------------------------------------------------------------------
# Shared by the scripts (no script imports another): the device

def pick_device(name="auto"):
    """'auto' -> cuda if a GPU is usable, else mps (Apple silicon), else cpu. An explicit name is
    checked, so a missing GPU is one clear error rather than a traceback from deep in torch."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    kind, _, index = name.partition(":")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but this torch has no usable CUDA GPU "
                         f"(torch {torch.__version__}); use --device cpu (or auto)")
    if kind == "cuda" and index.isdigit() and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if kind == "mps" and not has_mps:
        raise ValueError(f"device {name!r} was asked for, but MPS is not available here; "
                         "use --device cpu")
    if kind not in ("cuda", "mps", "cpu") or (kind != "cuda" and index):
        raise ValueError(f"unknown device {name!r}: choose auto, cpu, cuda, cuda:N or mps")
    return name


def cpu_threads():
    """Threads for a CPU's many small ops (a decode step runs hundreds): the cores that the 1-minute
    load average leaves free, at least 1, at most torch's default. NOTE: where every core is busy,
    each multithreaded op waits for a time slice: milliseconds, against a tenth of one of work."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(torch.get_num_threads(), cores - round(busy)))


def compile_works(device):
    """Whether torch.compile works here (it needs Triton on GPUs, a C++ compiler on CPU): if not, a
    note, not a traceback."""
    try:
        return torch.compile(lambda x: x + 1)(torch.ones(1, device=device)) is not None
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"note: torch.compile does not work here ({why}); training without it")
        return False


def sync(device):
    """Wait for the device's queued work (a no-op on CPU), so that a timer measures the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    elif torch.device(device).type == "mps":
        torch.mps.synchronize()


def git_state():
    """(commit, clean): the checked-out commit and whether the tracked files have no uncommitted
    changes; (None, None) without git. ORTHROS_GIT_COMMIT and ORTHROS_GIT_CLEAN (1 or 0), where
    set, say it instead: for a copy of the tree whose .git is missing or stale."""
    if os.environ.get("ORTHROS_GIT_COMMIT"):
        clean = os.environ.get("ORTHROS_GIT_CLEAN")
        return os.environ["ORTHROS_GIT_COMMIT"], (clean == "1") if clean in ("0", "1") else None
    try:
        git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                                           text=True, timeout=10).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return None, None
        return commit, git("status", "--porcelain", "--untracked-files=no") == ""
    except (OSError, subprocess.SubprocessError):
        return None, None


def run_meta(device="cpu"):
    """What a result file records about where it was measured (perf/bench.py, repro/)."""
    device = torch.device(device)
    commit, clean = git_state()
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": commit,
            "git_clean": clean}


# -----------------------------------------------------------------------------
# Shared by the scripts: the command line, whose errors are one line, and options generated from a
# config dataclass (train.py's TrainConfig), each with its help and its check

def fail(message):
    """Stop with one line on stderr: what is wrong and what to do."""
    raise SystemExit(f"error: {message}")


def note(message):
    """Print "note: message", once: not once per process under torchrun."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line ("error: --top_k must be >= 1"); --help shows all."""

    def error(self, message):
        message = re.sub(r"^argument (--\w+)(/-\w+)?: ", r"\1 ", message)
        raise SystemExit(f"error: {message}; {self.prog} --help lists every option")


def option(default, help, check=None):
    """A field of a config dataclass that parse_options makes an option: its default, its --help,
    and check = (accepts(value), what a value must be), e.g. at_least(1), for check_options."""
    return field(default=default, metadata={"help": help, "check": check})


def at_least(low):
    return (lambda v: v >= low), f"must be >= {low}"


def one_of(*choices):
    return (lambda v: v in choices), f"must be one of {', '.join(choices)}"


FRACTION = (lambda v: 0 <= v <= 1), "must be in [0, 1]"
BELOW_ONE = (lambda v: 0 <= v < 1), "must be in [0, 1)"


def parse_options(parser, config_class, argv, presets):
    """{name: value} of the options in argv: --config NAME (one of presets, {name: {field: value}}),
    then one --NAME per field of config_class (see option()), typed by the field. An unknown option,
    or a value not of its type, is a one-line error. --help lists them all, and the presets."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the description as written
    parser.epilog = "named configs (--config NAME; each sets what it lists):\n" + "\n".join(
        f"  {name:<17}" + (" ".join(f"{k}={v}" for k, v in preset.items()) or "the defaults")
        for name, preset in presets.items())
    parser.add_argument("--config", choices=presets, help="a named preset (see below)")
    for f in fields(config_class):
        text = f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%")
        parser.add_argument(f"--{f.name}", type=typed(f.type), default=argparse.SUPPRESS,
                            metavar=f.type.__name__.upper(), help=text)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        key = unknown[0].split("=")[0]
        parser.error(f"unknown option {key}" if key.startswith("--")
                     else f"expected --key value, got {unknown[0]!r}")
    return vars(args)


def typed(typ):
    """The argparse type of a field, whose error reads "takes an integer, got 'x'"."""
    def parse(value):
        try:
            if typ is bool:
                return {"true": True, "1": True, "false": False, "0": False}[value.lower()]
            return typ(value)
        except (KeyError, ValueError):
            words = {bool: "true or false", int: "an integer", float: "a float"}[typ]
            raise argparse.ArgumentTypeError(f"takes {words}, got {value!r}") from None
    return parse


def check_options(config):
    """Stop with one line at the first field of config whose check refuses its value."""
    for f in fields(config):
        accepts, must = f.metadata["check"] or (lambda v: True, "")
        if not accepts(getattr(config, f.name)):
            fail(f"--{f.name} {must}, got {getattr(config, f.name)!r}")
