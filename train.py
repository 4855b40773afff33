"""
Train Orthros, or a baseline, on one GPU, on CPU, or on several GPUs with torchrun.

    python train.py --config tiny                      # 2 CPU cores: 150 steps in about 10 s
    python train.py --config small                     # one GPU: about 2 minutes on an H200
    python train.py --config small --attn transformer  # the baselines: transformer | swa
    python train.py --config small --scale_offset false   # the paper's "w/o SO" ablation
    python train.py --config small --init_from resume  # continue the run in out_dir from ckpt_last.pt
    torchrun --standalone --nproc_per_node=2 train.py --config small   # DistributedDataParallel
    python train.py --config recall_tiny               # SFT on the recall task (2 CPU cores, minutes)
    python train.py --config tiny --task sft --dataset data/sft_example --init_from out/tiny-orthros/ckpt_best.pt

Every field of TrainConfig is an option (--key value or --key=value), type-checked; unknown keys
are errors. Pre-training (--task pretrain) draws random windows of seq_len tokens from
data/<dataset>/train.bin and trains every position (t_out = T). SFT (--task sft) reads
train.jsonl / val.jsonl (format: data/sft.py) from data/<dataset>/ or from a folder path,
trains only the responses, and uses the smallest t_out that covers them; with a test.jsonl
it ends with the exact-match accuracy of greedy generation through the KV cache.

A run never writes over another run's files. The default out_dir names the config, the model
and, for SFT on a pre-training config, the task and dataset (out/tiny-orthros-sft-sft_example).
An out_dir that already holds a run is refused unless you continue it (--init_from resume) or
replace it (--overwrite true), and a run may never write into the folder of the checkpoint it
starts from. Ctrl-C (or SIGTERM) stops after the current step and saves ckpt_last.pt.
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import load_checkpoint, save_checkpoint
from common import ArgumentParser, atomic_write, pick_device
from data.prepare_utils import DATA_ROOT, available_datasets, ensure_prepared, load_meta
from data.sft import collate, exact_match, has_prompt, load_examples, read_examples_dir
from data.tokenizer import get_tokenizer
from orthros import ATTN_TYPES, SWA_IMPLS, Orthros, OrthrosConfig


@dataclass
class TrainConfig:
    # data
    task: str = "pretrain"         # pretrain (every position predicts) | sft (prompt/response JSONL)
    dataset: str = "stdlib"        # a name in data/ (prepared on first use), or a folder path (SFT JSONL)
    tokenizer: str = ""            # "" = the dataset's (its meta.json), else byte | gpt2
    sft_overlong: str = "drop"     # SFT examples longer than seq_len: drop | truncate (drops the oldest tokens)
    curriculum: str = ""           # SFT: a split (e.g. train_short) used for the first curriculum_frac of steps
    curriculum_frac: float = 0.5   # SFT: share of the steps that use the curriculum split
    eval_exact_match: int = -1     # SFT: test examples to generate at the end (-1 = all, 0 = none)
    # model (see OrthrosConfig in orthros.py)
    attn: str = "orthros"          # orthros | transformer | swa
    scale_offset: bool = True      # false = the paper's "Orthros w/o SO" ablation
    window: int = 128              # w, the sliding window (the paper uses 128)
    n_layer: int = 6               # layers
    n_head: int = 6                # attention heads (n_embd / n_head must be even)
    n_embd: int = 384              # model width C
    dropout: float = 0.0           # dropout on embeddings, attention and residual branches
    conv_kernel: int = 0           # optional short convolution before K and V (not in the paper; 0 = off)
    swa_impl: str = "auto"         # sliding-window kernel: auto (flex on CUDA, else blocked) | flex | blocked | dense
    seq_len: int = 1024            # T, tokens per training sequence
    max_seq_len: int = 0           # longest sequence the model accepts; 0 = seq_len
    # optimization: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    batch_size: int = 16           # sequences per micro-step (per GPU under torchrun)
    grad_accum: int = 1            # micro-steps per optimizer step
    max_iters: int = 2000          # optimizer steps in all (0 = evaluate and save the initial model)
    lr: float = 1e-3               # peak learning rate
    min_lr_ratio: float = 0.1      # the final learning rate, as a fraction of lr
    warmup_iters: int = 100        # steps of linear warmup
    weight_decay: float = 0.1      # AdamW weight decay, on matrices only
    beta1: float = 0.9             # AdamW beta1
    beta2: float = 0.95            # AdamW beta2
    grad_clip: float = 1.0         # clip the gradient norm to this (0 = off)
    # evaluation, logging, checkpoints
    eval_interval: int = 250       # evaluate and checkpoint every this many steps
    eval_iters: int = 20           # batches per split in each evaluation
    out_dir: str = ""              # where logs and checkpoints go; "" = out/<config>-<attn>[-sft-<dataset>]
    init_from: str = "scratch"     # scratch | resume (out_dir/ckpt_last.pt) | path/to/ckpt.pt (e.g. a transformer to convert)
    overwrite: bool = False        # true = replace the run already in out_dir (its log and checkpoints are deleted)
    seed: int = 1337               # seeds the weights, the batches and the dropout
    device: str = "auto"           # auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"            # auto (bf16 autocast where supported, else fp32) | float32 | bfloat16
    compile: bool = False          # torch.compile each block (model.compile_blocks())


# Named presets: each changes only what differs from the defaults above.
CONFIGS = {
    # About 10 s on 2 CPU cores: enough to watch the loss fall.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, window=32, seq_len=128, batch_size=16,
                 max_iters=150, lr=3e-3, warmup_iters=10, eval_interval=50, eval_iters=5),
    # A GPU command: about 2 minutes on one H200 (hours on a CPU). Head dim 64, window 128 as in the paper.
    "small": dict(),
    # The recall task (data/recall), SFT from scratch, window 128: minutes on one GPU.
    "recall": dict(task="sft", dataset="recall", n_layer=2, n_head=4, n_embd=64, window=128, conv_kernel=3,
                   seq_len=2200, batch_size=32, max_iters=2400, lr=3e-3, warmup_iters=50, eval_interval=400,
                   eval_iters=5, curriculum="train_short", curriculum_frac=0.75, weight_decay=0.0),
    # The same at window 32 (data/recall_tiny): a couple of minutes on 2 CPU cores.
    "recall_tiny": dict(task="sft", dataset="recall_tiny", n_layer=2, n_head=4, n_embd=64, window=32, curriculum_frac=0.75,
                        conv_kernel=3, seq_len=384, batch_size=32, max_iters=2400, lr=3e-3, warmup_iters=50,
                        eval_interval=200, eval_iters=5, curriculum="train_short", weight_decay=0.0),
}

# Fields that define the weights' shapes: a checkpoint's values win over the command line.
SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "conv_kernel")
# The files a run writes into its out_dir.
RUN_FILES = ("log.jsonl", "ckpt_last.pt", "ckpt_best.pt", "exact_match.json")


def fail(message):
    """Stop with one line on stderr: what is wrong and what to do."""
    raise SystemExit(f"error: {message}")


# -----------------------------------------------------------------------------
# The command line, generated from TrainConfig: each field's comment is its help

def field_help():
    """{field name: the comment after it in TrainConfig's source}."""
    return dict(re.findall(r"^\s+(\w+): \w+ = .*?#\s*(.*)$", inspect.getsource(TrainConfig), re.M))


def value_parser(typ):
    """The argparse type for a field's annotation, with errors that read 'takes an integer, got ...'."""
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ)  # annotations may be strings
    def parse(value):
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"takes true or false, got {value!r}")
        try:
            return typ(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {'an integer' if typ is int else 'a ' + typ.__name__}, "
                                             f"got {value!r}") from None
    return parse


def config_name(name):
    if name not in CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown config {name!r}; choose one of {', '.join(CONFIGS)}")
    return name


def build_parser():
    presets = "\n".join(f"  {name:<12} " + (" ".join(f"{k}={v}" for k, v in preset.items()) or "the defaults below")
                        for name, preset in CONFIGS.items())
    parser = ArgumentParser(prog="python train.py", description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"named configs (--config NAME; each sets only what it lists):\n{presets}")
    parser.add_argument("--config", default="small", type=config_name, metavar="NAME",
                        help=f"a named preset: {', '.join(CONFIGS)} (default: small)")
    helps = field_help()
    for f in fields(TrainConfig):
        parser.add_argument(f"--{f.name}", type=value_parser(f.type), default=argparse.SUPPRESS,
                            metavar=str(f.type if isinstance(f.type, str) else f.type.__name__).upper(),
                            help=f"{helps.get(f.name, '')} (default: {f.default!r})".replace("%", "%%"))
    return parser


def parse_args(argv):
    """--config NAME plus --key value overrides -> (config name, TrainConfig)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        key = unknown[0].split("=")[0]
        if not key.startswith("--"):
            fail(f"expected --key value, got {unknown[0]!r}")
        close = [f.name for f in fields(TrainConfig) if f.name.startswith(key[2:5])]
        fail(f"unknown option {key}" + (f" (did you mean {', '.join('--' + k for k in close)}?)" if close else "")
             + "; python train.py --help lists every option")
    values = vars(args)
    name = values.pop("config")
    cfg = TrainConfig(**{**CONFIGS[name], **values})
    if not cfg.out_dir:
        cfg.out_dir = default_out_dir(name, cfg)
    return name, cfg


def default_out_dir(config_name, cfg):
    """out/<config>-<attn>[-noso]; SFT on a pre-training config adds -sft-<dataset>, so fine-tuning
    a checkpoint never lands in the folder of the run it starts from."""
    name = f"out/{config_name}-{cfg.attn}" + ("-noso" if cfg.attn == "orthros" and not cfg.scale_offset else "")
    if cfg.task != CONFIGS[config_name].get("task", "pretrain"):
        name += f"-{cfg.task}-{Path(cfg.dataset).name or 'data'}"
    return name


def check_config(cfg):
    """Every option's range, before anything is read or written."""
    choices = {"task": ("pretrain", "sft"), "attn": ATTN_TYPES, "swa_impl": SWA_IMPLS,
               "sft_overlong": ("drop", "truncate"), "dtype": ("auto", "float32", "bfloat16")}
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            fail(f"--{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")
    at_least = {"batch_size": 1, "grad_accum": 1, "eval_interval": 1, "eval_iters": 1, "seq_len": 1, "window": 1,
                "n_layer": 1, "n_head": 1, "n_embd": 1, "max_iters": 0, "warmup_iters": 0, "max_seq_len": 0,
                "conv_kernel": 0, "lr": 0, "weight_decay": 0, "grad_clip": 0}
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            fail(f"--{key} must be >= {low}, got {getattr(cfg, key)}")
    intervals = {"min_lr_ratio": "[0, 1]", "curriculum_frac": "[0, 1]", "beta1": "[0, 1)", "beta2": "[0, 1)",
                 "dropout": "[0, 1)"}
    for key, interval in intervals.items():
        value = getattr(cfg, key)
        if not 0 <= value <= 1 or (interval.endswith(")") and value == 1):
            fail(f"--{key} must be in {interval}, got {value}")
    if cfg.max_seq_len and cfg.max_seq_len < cfg.seq_len:
        fail(f"--max_seq_len ({cfg.max_seq_len}) must be 0 or >= --seq_len ({cfg.seq_len})")
    if cfg.tokenizer not in ("", "byte", "gpt2"):
        fail(f"--tokenizer must be byte or gpt2 (or empty for the dataset's), got {cfg.tokenizer!r}")


# -----------------------------------------------------------------------------
# Data: random windows of the token stream, the same on every rank until split by rank

def resolve_dataset(cfg, master):
    """The dataset folder: a path given on the command line, or data/<name>/ (prepared on first use)."""
    given = Path(cfg.dataset).expanduser()
    looks_like_path = os.sep in cfg.dataset or cfg.dataset.startswith((".", "~")) or given.is_dir()
    if looks_like_path:
        if not given.is_dir():
            fail(f"--dataset {cfg.dataset}: no such folder")
        return given
    if cfg.dataset not in available_datasets():
        fail(f"unknown dataset {cfg.dataset!r}: give a folder path, or one of {available_datasets()} "
             "(each a folder data/<name>/ with a prepare.py)")
    try:
        return ensure_prepared(cfg.dataset) if master else DATA_ROOT / cfg.dataset
    except (ValueError, OSError, RuntimeError) as e:  # no source file, no network
        fail(f"preparing dataset {cfg.dataset!r} failed: {e}")


class PretrainBatches:
    def __init__(self, data_dir, seq_len, device):
        self.paths = {split: Path(data_dir) / f"{split}.bin" for split in ("train", "val")}
        self.seq_len, self.device = seq_len, device
        for split, path in self.paths.items():
            if not path.is_file():
                hint = ("it holds SFT data (train.jsonl): add --task sft" if (Path(data_dir) / "train.jsonl").exists()
                        else "prepare it first (data/<name>/prepare.py writes train.bin and val.bin)")
                fail(f"{data_dir} has no {split}.bin for pre-training; {hint}")
            n = len(np.memmap(path, dtype=np.uint16, mode="r"))
            if n <= seq_len + 1:
                fail(f"{path} has {n} tokens, fewer than seq_len + 2 = {seq_len + 2}; lower --seq_len or prepare more data")

    def get(self, split, batch_size, generator):
        """(x, y, t_out): x, y of shape (batch_size, T), y = x shifted by one; t_out = T."""
        # A fresh memmap per batch, as nanoGPT does: it keeps memory from growing.
        data = np.memmap(self.paths[split], dtype=np.uint16, mode="r")
        T = self.seq_len
        ix = torch.randint(len(data) - T - 1, (batch_size,), generator=generator).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x.to(self.device), y.to(self.device), T


class SFTBatches:
    """Random batches of SFT examples (data/sft.py), right-padded, with the smallest t_out."""

    def __init__(self, data_dir, cfg, tokenizer, device, log=print):
        splits = read_examples_dir(data_dir)
        if not splits and list(Path(data_dir).glob("*.bin")):
            fail(f"{data_dir} holds pre-training data (*.bin), not SFT JSONL: drop --task sft, or point "
                 "--dataset at a folder with train.jsonl and val.jsonl")
        for needed in ("train", "val") + ((cfg.curriculum,) if cfg.curriculum else ()):
            if needed not in splits:
                fail(f"{data_dir} has no {needed}.jsonl (SFT needs train.jsonl and val.jsonl"
                     + (f", and {cfg.curriculum}.jsonl for --curriculum" if cfg.curriculum else "") + ")")
        self.examples = {}
        for name, path in splits.items():
            try:
                self.examples[name], report = load_examples(path, tokenizer, cfg.seq_len, cfg.sft_overlong)
            except (ValueError, UnicodeDecodeError) as e:
                fail(str(e))
            log(report)
        self.device = device

    def get(self, split, batch_size, generator):
        pool = self.examples[split]
        ix = torch.randint(len(pool), (batch_size,), generator=generator).tolist()
        x, y, t_out = collate([pool[i] for i in ix])
        return x.to(self.device), y.to(self.device), t_out


# -----------------------------------------------------------------------------
# The pieces of a run: the model, the optimizer, the schedule, evaluation

def load_init_checkpoint(cfg):
    """The checkpoint the run starts from: None (scratch), out_dir/ckpt_last.pt (resume), or a path."""
    if cfg.init_from == "scratch":
        return None
    path = Path(cfg.out_dir) / "ckpt_last.pt" if cfg.init_from == "resume" else Path(cfg.init_from)
    try:
        return load_checkpoint(path)
    except FileNotFoundError:
        if cfg.init_from == "resume":
            fail(f"--init_from resume: no checkpoint at {path} to resume. Check --out_dir (or --config and "
                 "--attn, which set the default out_dir); a run saves ckpt_last.pt at every eval and on Ctrl-C")
        fail(f"--init_from {cfg.init_from}: no such checkpoint file")
    except ValueError as e:
        fail(f"--init_from {cfg.init_from}: {e}")


def build_model(config_name, cfg, ckpt, vocab_size, device):
    """The model from scratch, resumed, or initialised from another checkpoint's weights."""
    model_args = dict(vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                      window=cfg.window, attn=cfg.attn, scale_offset=cfg.scale_offset, dropout=cfg.dropout,
                      conv_kernel=cfg.conv_kernel, swa_impl=cfg.swa_impl, max_seq_len=cfg.max_seq_len or cfg.seq_len)
    if ckpt is not None:
        # Shapes come from the checkpoint (its weights have them); on resume everything does.
        preset = TrainConfig(**CONFIGS[config_name])
        ignored = [f"--{k} {getattr(cfg, k)}" for k in SHAPE_FIELDS[1:]
                   if getattr(cfg, k) != getattr(preset, k) and getattr(cfg, k) != ckpt["model_config"][k]]
        if ignored:
            print(f"note: {', '.join(ignored)} ignored: the checkpoint's shape wins ("
                  + ", ".join(f"{k}={ckpt['model_config'][k]}" for k in SHAPE_FIELDS[1:]) + ")")
        if cfg.init_from == "resume":
            model_args = dict(ckpt["model_config"])  # resume the very same model
        else:  # attn, window, scale_offset from this run: transformer -> orthros is the paper's conversion
            model_args.update({k: ckpt["model_config"][k] for k in SHAPE_FIELDS})
            model_args["max_seq_len"] = max(model_args["max_seq_len"], cfg.seq_len)
    try:
        model = Orthros(OrthrosConfig(**model_args)).to(device)
    except ValueError as e:  # e.g. heads that do not divide n_embd
        fail(str(e))
    if ckpt is not None and cfg.init_from == "resume":
        model.load_state_dict(ckpt["model"])
    elif ckpt is not None:
        try:
            model.load_transformer_weights(ckpt["model"])
        except ValueError as e:
            fail(f"--init_from {cfg.init_from}: {e}")
    return model


def lr_at(step, cfg):
    """Linear warmup, then cosine decay from lr to min_lr_ratio * lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, cfg, device_type):
    # Weight decay on matrices only; norms, scale-offsets and the convolution are left alone.
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device_type == "cuda")


def autocast_context(cfg, device_type):
    """bf16 autocast where the device supports it (auto), else plain fp32."""
    want_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device_type == "cuda"
                                             and torch.cuda.is_bf16_supported())
    if not want_bf16:
        return nullcontext(), "float32"
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16), "bfloat16 autocast"


def compile_works(device):
    """torch.compile needs a working compiler toolchain (Triton on GPUs, a C++ compiler on CPU).
    Try it on a tiny function first, so a platform without one gets a message, not a traceback."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(8, device=device))
        return True
    except Exception as e:
        print(f"note: torch.compile does not work here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "training without it")
        return False


def rng_state(generator, device_type):
    state = {"data": generator.get_state(), "torch": torch.get_rng_state()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state, generator, device_type):
    generator.set_state(state["data"])
    torch.set_rng_state(state["torch"])
    if device_type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@torch.no_grad()
def estimate_loss(model, batches, cfg, ctx, seed, desc="eval"):
    """Mean loss over eval_iters batches per split; the same batches every time (fixed seed)."""
    model.eval()
    out = {}
    with tqdm(total=2 * cfg.eval_iters, desc=desc, unit="batch", leave=False, dynamic_ncols=True) as bar:
        for split in ("train", "val"):
            gen = torch.Generator().manual_seed(seed)
            losses = []
            for _ in range(cfg.eval_iters):
                x, y, t_out = batches.get(split, cfg.batch_size, gen)
                with ctx:
                    _, loss = model(x, y, t_out=t_out)
                losses.append(loss.item())
                bar.update(1)
            out[split] = sum(losses) / len(losses)
    model.train()
    return out


def generate_greedy(model, device, ctx):
    """A function (prompts, n) -> continuations for data.sft.exact_match: greedy, KV cache."""
    @torch.no_grad()
    def generate(prompts, n_new):
        model.eval()
        idx = torch.tensor(prompts, device=device)
        with ctx:
            out = model.generate(idx, n_new, temperature=0)
        model.train()
        return out[:, idx.size(1):].tolist()
    return generate


# -----------------------------------------------------------------------------
# The run's folder: never write over another run's files

def claim_out_dir(cfg):
    """Check, before anything is written, that this run may write into out_dir."""
    out_dir = Path(cfg.out_dir)
    if cfg.init_from not in ("scratch", "resume") and out_dir.resolve() in Path(cfg.init_from).resolve().parents:
        fail(f"--init_from {cfg.init_from} lies in --out_dir {out_dir}: this run would write over the run it "
             "starts from. Give it its own --out_dir")
    if cfg.init_from == "resume":
        return
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if present and not cfg.overwrite:
        fail(f"{out_dir} already holds a run ({', '.join(present)}). Continue it with --init_from resume, "
             "start a new one with --out_dir NEW_DIR, or replace it with --overwrite true")


def open_log(cfg, start_step):
    """out_dir/log.jsonl, opened for appending. A resumed run first drops the records after its
    checkpoint's step (they are about to be redone), so no step is listed twice. --overwrite
    deletes the previous run's files first."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "log.jsonl"
    if cfg.init_from == "resume" and path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= start_step]
        atomic_write(path, lambda f: f.write("".join(kept)), mode="w")
    elif cfg.overwrite:
        for name in RUN_FILES:
            (out_dir / name).unlink(missing_ok=True)
    return open(path, "a")


class StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM ask the training loop to stop after the current step and save
    ckpt_last.pt. A second Ctrl-C stops at once (KeyboardInterrupt), without saving."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.signal is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C; a repeated SIGTERM (a supervisor's) just waits
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        tqdm.write(f"{self.signal}: stopping after this step and saving ckpt_last.pt "
                   "(Ctrl-C again stops at once, without saving)")


def resume_command(argv):
    """The command line that continues this run: the same options with --init_from resume."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        key = arg.split("=")[0]
        if key in ("--init_from", "--overwrite"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    return " ".join(["python train.py", *kept, "--init_from resume"])


# -----------------------------------------------------------------------------
# One run: main() reads and checks everything, then trains, then reports

class Run:
    """A training run: its model, optimizer, data, log and checkpoints in cfg.out_dir."""

    def __init__(self, config_name, cfg, argv):
        self.config_name, self.cfg, self.argv = config_name, cfg, argv
        try:
            device = pick_device(cfg.device)
        except ValueError as e:
            fail(str(e))
        # torchrun sets RANK/WORLD_SIZE; otherwise this is a single process.
        self.ddp = int(os.environ.get("RANK", -1)) != -1
        self.rank, self.world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        if self.ddp:
            if device.startswith("cuda"):
                device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
                torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        self.master = self.rank == 0
        self.device, self.device_type = device, torch.device(device).type
        torch.manual_seed(cfg.seed)
        self.ctx, self.precision = autocast_context(cfg, self.device_type)

        self.data_dir = resolve_dataset(cfg, self.master)
        if self.ddp:
            dist.barrier()  # rank 0 prepares the data once; the others wait for it
        meta = load_meta(self.data_dir) if (self.data_dir / "meta.json").exists() else {}
        ckpt = load_init_checkpoint(cfg)
        self.init_ckpt = ckpt
        # The tokenizer: asked for, else the dataset's, else the checkpoint's, else bytes. They must agree.
        self.tokenizer_name = cfg.tokenizer or meta.get("tokenizer") or (ckpt or {}).get("tokenizer") or "byte"
        for source, name in (("the dataset", meta.get("tokenizer")), ("the checkpoint", (ckpt or {}).get("tokenizer"))):
            if name and name != self.tokenizer_name:
                fail(f"{source} uses the {name!r} tokenizer but this run uses {self.tokenizer_name!r}; "
                     "a model only understands the tokenizer it was trained with")
        try:
            tokenizer = get_tokenizer(self.tokenizer_name)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            fail(str(e).splitlines()[0])
        self.batches = (PretrainBatches(self.data_dir, cfg.seq_len, device) if cfg.task == "pretrain"
                        else SFTBatches(self.data_dir, cfg, tokenizer, device, log=self.print))
        self.raw_model = build_model(config_name, cfg, ckpt, tokenizer.vocab_size, device)
        self.optimizer = make_optimizer(self.raw_model, cfg, self.device_type)
        self.train_gen = torch.Generator().manual_seed(cfg.seed)  # draws the training batches
        self.step, self.best_val = 0, float("inf")
        if ckpt is not None and cfg.init_from == "resume":
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.step, self.best_val = ckpt["step"], ckpt["best_val_loss"]
            set_rng_state(ckpt["rng"], self.train_gen, self.device_type)
        self.start_step = self.step
        self.out_dir = Path(cfg.out_dir)
        self.saved = {}        # checkpoint name -> the step this run saved it at
        self.log_file = None
        self.stop = None

    def print(self, *args):
        if self.master:
            print(*args)

    def start(self):
        """Claim out_dir (only now is anything written), print the setup, open the log."""
        cfg = self.cfg
        claim_out_dir(cfg)
        if self.ddp:
            dist.barrier()  # every rank has checked out_dir before rank 0 writes into it
        self.print(f"config {self.config_name}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
        self.print(f"model: {self.raw_model.num_params() / 1e6:.2f}M parameters, {self.raw_model.config}")
        self.print(f"device {self.device} ({self.precision}), world size {self.world}, data {self.data_dir} "
                   f"({self.tokenizer_name} tokenizer)")
        if self.init_ckpt is not None:
            self.print(f"initialised from {cfg.init_from}" + (f" at step {self.step}" if self.step else ""))
        self.model = self.raw_model
        if cfg.compile and compile_works(self.device):
            self.model.compile_blocks()
        if self.ddp:
            self.model = DDP(self.model, device_ids=[int(self.device.split(":")[1])] if self.device_type == "cuda" else None)
        if self.master:
            self.log_file = open_log(cfg, self.step)

    def log(self, record):
        if self.master:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def checkpoint(self, name):
        save_checkpoint(self.out_dir / name, model=self.raw_model.state_dict(), optimizer=self.optimizer.state_dict(),
                        step=self.step, best_val_loss=self.best_val, model_config=dataclasses.asdict(self.raw_model.config),
                        train_config=dataclasses.asdict(self.cfg), config_name=self.config_name,
                        tokenizer=self.tokenizer_name, dataset=self.cfg.dataset,
                        rng=rng_state(self.train_gen, self.device_type))
        self.saved[name] = self.step

    def evaluate(self):
        """Train and val loss on fixed batches; after training has started, save ckpt_last.pt (and ckpt_best.pt)."""
        losses = estimate_loss(self.raw_model, self.batches, self.cfg, self.ctx, seed=self.cfg.seed + 1,
                               desc=f"eval at step {self.step}")
        self.log({"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
        tqdm.write(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if self.step > self.start_step:
            if losses["val"] < self.best_val:
                self.best_val = losses["val"]
                self.checkpoint("ckpt_best.pt")
            self.checkpoint("ckpt_last.pt")

    def train(self):
        """Steps until max_iters, or until SIGINT/SIGTERM asks to stop; then ckpt_last.pt is saved."""
        cfg = self.cfg
        with StopRequest() as self.stop:
            if self.master and self.step == 0:
                self.evaluate()
            pbar = tqdm(total=cfg.max_iters, initial=self.step, disable=not self.master, unit="step", dynamic_ncols=True)
            t_last = time.time()
            while self.step < cfg.max_iters and not self.stop_requested():
                record = self.train_step()
                now = time.time()
                record["tok_per_s"] = record.pop("tokens") / (now - t_last)
                t_last = now
                self.log(record)
                pbar.update(1)
                pbar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tok_per_s']:,.0f}",
                                 **({"t_out/T": f"{record['t_out_share']:.2f}"} if cfg.task == "sft" else {}))
                if self.master and (self.step % cfg.eval_interval == 0 or self.step == cfg.max_iters):
                    self.evaluate()
            pbar.close()
            if self.master and self.saved.get("ckpt_last.pt") != self.step:
                self.checkpoint("ckpt_last.pt")  # after a stop request, and for --max_iters 0
        if self.stop.signal is not None:
            self.print(f"stopped by {self.stop.signal} after step {self.step}; saved {self.out_dir}/ckpt_last.pt. "
                       f"Resume with: {resume_command(self.argv)}")
            raise SystemExit(130)

    def train_step(self):
        """One optimizer step (grad_accum micro-steps). Returns its log record."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        split = cfg.curriculum if cfg.curriculum and step < cfg.curriculum_frac * cfg.max_iters else "train"
        loss_sum = torch.zeros((), device=self.device)
        n_tokens, out_share = 0, 0.0
        for micro in range(cfg.grad_accum):
            # Every rank draws the same global batch and keeps its own slice, so the result does
            # not depend on how many processes share the work.
            x, y, t_out = self.batches.get(split, cfg.batch_size * self.world, self.train_gen)
            mine = slice(self.rank * cfg.batch_size, (self.rank + 1) * cfg.batch_size)
            x, y = x[mine], y[mine]
            n_tokens += x.numel() * self.world
            out_share += t_out / x.size(1) / cfg.grad_accum  # 1.0 in pre-training; SFT runs T + t_out, not 2T
            sync = not self.ddp or micro == cfg.grad_accum - 1
            with self.ctx, (nullcontext() if sync else self.model.no_sync()):
                _, loss = self.model(x, y, t_out=t_out)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach() / cfg.grad_accum
        if self.ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        train_loss = loss_sum.item()
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"the training loss is {train_loss} at step {step + 1}")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip or float("inf")).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": train_loss, "lr": lr, "grad_norm": grad_norm, "tokens": n_tokens,
                "t_out_share": out_share}

    def stop_requested(self):
        """Whether a stop was asked for, on any rank (they must all stop at the same step)."""
        if not self.ddp:
            return self.stop.signal is not None
        flag = torch.tensor(float(self.stop.signal is not None), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.stop.signal is None:
            self.stop.signal = "a stop request on another rank"
        return bool(flag.item())

    def close(self):
        if self.log_file is not None:
            self.log_file.close()
        if self.ddp:
            dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config_name, cfg = parse_args(argv)
    check_config(cfg)
    run = Run(config_name, cfg, argv)  # reads and checks everything; writes nothing
    if run.step >= cfg.max_iters and cfg.init_from == "resume":
        run.print(f"nothing to do: {cfg.out_dir}/ckpt_last.pt is at step {run.step} and --max_iters is "
                  f"{cfg.max_iters}; raise --max_iters to train further")
        return run.best_val
    try:
        run.start()
        run.train()
        if run.master and cfg.task == "sft":
            sft_report(run)
    except FloatingPointError as e:
        if run.master:
            last = (f"the last good checkpoint ({run.out_dir}/ckpt_last.pt, step {run.saved['ckpt_last.pt']}) is untouched"
                    if "ckpt_last.pt" in run.saved else "no checkpoint had been written yet")
            print(f"\nerror: {e}. Stopping; {last}. Try a lower --lr, or --dtype float32.", file=sys.stderr)
        raise SystemExit(1)
    finally:
        run.close()
    if run.master:
        best = (f"best val loss {run.best_val:.4f} (ckpt_best.pt, step {run.saved['ckpt_best.pt']})"
                if "ckpt_best.pt" in run.saved else "no evaluation after training started, so no ckpt_best.pt")
        print(f"done: {run.step} steps; {best}; ckpt_last.pt at step {run.step}; in {run.out_dir}/")
    return run.best_val


def sft_report(run):
    """What the T_in/T_out split saved, and the exact-match accuracy on test.jsonl if there is one."""
    cfg = run.cfg
    shares = [json.loads(line).get("t_out_share") for line in open(run.out_dir / "log.jsonl")]
    shares = [s for s in shares if s is not None]
    if shares:
        mean = sum(shares) / len(shares)
        print(f"SFT: the output stream covered {mean:.1%} of the positions on average: the T_in/T_out "
              f"split saved {1 - mean:.1%} of the output-token work against t_out = T")
    if not cfg.eval_exact_match or "test" not in run.batches.examples:
        return
    examples = run.batches.examples["test"]
    examples = examples if cfg.eval_exact_match < 0 else examples[:cfg.eval_exact_match]
    scorable = [ex for ex in examples if has_prompt(ex)]
    if len(scorable) < len(examples):
        print(f"note: {len(examples) - len(scorable)} of {len(examples)} test examples are not scored: "
              "truncation to seq_len left no prompt before their answer")
    if not scorable:
        return
    scores = exact_match(scorable, generate_greedy(run.raw_model, run.device, run.ctx))
    run.log({"step": run.step, "exact_match": scores})
    atomic_write(run.out_dir / "exact_match.json", lambda f: f.write(json.dumps(scores, indent=2) + "\n"), mode="w")
    if list(scores) == ["all"]:
        print(f"exact-match accuracy of greedy generation (KV cache) on test.jsonl: "
              f"{scores['all']['accuracy']:.3f} ({scores['all']['n']} examples)")
    else:
        print("exact-match accuracy of greedy generation (KV cache) on test.jsonl, by bucket:")
        for bucket, r in scores.items():
            print(f"  {bucket:>12}: {r['accuracy']:.3f}  ({r['n']} examples)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        sys.exit("\ninterrupted: stopped at once; checkpoints already in out_dir are whole (they are written atomically)")
