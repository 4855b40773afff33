"""
Train Orthros, or a baseline, on one GPU, on CPU, or on several GPUs with torchrun.

    python train.py --config tiny                      # 2 CPU cores: 150 steps, about 17 s in all
    python train.py --config small                     # one GPU: about 2 minutes on an H200
    python train.py --config small --attn transformer  # the baselines: transformer | swa
    python train.py --config small --scale_offset false   # the paper's "w/o SO" ablation
    python train.py --config shakespeare_char          # nanoGPT's character-level benchmark, one GPU
    python train.py --config small --init_from resume  # continue the run in out_dir from ckpt_last.pt
    python train.py --config tiny --task sft --dataset data/sft_example --init_from out/tiny-orthros/ckpt_best.pt
    torchrun --standalone --nproc_per_node=2 train.py --config small   # DistributedDataParallel
    torchrun --standalone --nproc_per_node=8 train.py ... --fsdp true  # sharded (FSDP2): models one GPU cannot hold

Every field of TrainConfig is an option (--help lists them). Pre-training trains every position
(t_out = T); SFT trains only the responses, with the smallest t_out that covers them (data/sft.py).
A run never writes over another run's files, and Ctrl-C stops after the step and saves ckpt_last.pt.
On a terminal a progress bar shows the steps; into a file or a pipe, one line per log_interval steps.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import (ArgumentParser, claim_out_dir, compile_works, link_best, load_start, open_log, pick_device, resume_command,
                        restore_training_state, save_checkpoint, sync, training_state)
from data.prepare_utils import PretrainBatches, atomic_write, find_dataset, load_meta
from data.sft import SFTBatches, exact_match_report
from data.tokenizer import get_tokenizer
from orthros import IGNORE, Orthros, OrthrosConfig, compile_blocks
from perf.flops import forward_flops, peak_flops


def option(default, help, check=None):
    """A TrainConfig field: default, --help text, check = (accepts(value), words) (model fields: OrthrosConfig's)."""
    return field(default=default, metadata={"help": help, "check": check})


at_least = lambda low: ((lambda v: v >= low), f"must be >= {low}")  # the checks: (accepts(value), words)
one_of = lambda *choices: ((lambda v: v in choices), f"must be one of {', '.join(choices)}")
FRACTION, BELOW_ONE = ((lambda v: 0 <= v <= 1), "must be in [0, 1]"), ((lambda v: 0 <= v < 1), "must be in [0, 1)")


@dataclass
class TrainConfig:
    # data
    task: str = option("pretrain", "pretrain (every position predicts) | sft (prompt/response JSONL)", one_of("pretrain", "sft"))
    dataset: str = option("stdlib", "a name in data/ (prepared on first use), or a folder path (SFT JSONL)")
    sft_overlong: str = option("drop", "SFT examples longer than seq_len: drop | truncate (the oldest tokens)", one_of("drop", "truncate"))
    data_order: str = option("random", "pretrain: random windows (nanoGPT's) | epoch (disjoint "
                             "windows, each once per epoch)", one_of("random", "epoch"))
    curriculum: str = option("", "SFT: a split (e.g. train_short) used for the first curriculum_frac of steps")
    curriculum_frac: float = option(0.5, "SFT: share of the steps that use the curriculum split", FRACTION)
    eval_exact_match: int = option(-1, "SFT: test examples to generate at the end (-1 = all, 0 = none)", at_least(-1))
    # model: OrthrosConfig in orthros.py
    attn: str = option("orthros", "orthros | transformer | swa")
    scale_offset: bool = option(True, "false = the paper's 'Orthros w/o SO' ablation")
    window: int = option(128, "w, the sliding window (the paper uses 128)")
    n_layer: int = option(6, "layers")
    n_head: int = option(6, "attention heads (n_embd / n_head must be even)")
    n_embd: int = option(384, "model width C")
    dropout: float = option(0.0, "dropout on embeddings, attention and residual branches", BELOW_ONE)
    conv_kernel: int = option(0, "optional short convolution before K and V (not in the paper; 0 = off)")
    seq_len: int = option(1024, "T, tokens per training sequence", at_least(1))
    max_seq_len: int = option(0, "longest sequence the model accepts; 0 = seq_len", at_least(0))
    # optimization: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    batch_size: int = option(16, "sequences per micro-step (per GPU under torchrun)", at_least(1))
    grad_accum: int = option(1, "micro-steps per optimizer step", at_least(1))
    max_iters: int = option(2000, "optimizer steps in all (0 = evaluate and save the initial model)", at_least(0))
    lr: float = option(1e-3, "peak learning rate (from --init_from hf:DIR: train.PRETRAINED_LR = 1e-4)", at_least(0))
    min_lr_ratio: float = option(0.1, "the final learning rate, as a fraction of lr", FRACTION)
    warmup_iters: int = option(100, "steps of linear warmup", at_least(0))
    weight_decay: float = option(0.1, "AdamW weight decay, on matrices only", at_least(0))
    beta1: float = option(0.9, "AdamW beta1", BELOW_ONE)
    beta2: float = option(0.95, "AdamW beta2", BELOW_ONE)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0 = off)", at_least(0))
    # evaluation, logging, checkpoints
    eval_interval: int = option(250, "evaluate and checkpoint every this many steps", at_least(1))
    eval_iters: int = option(20, "batches per split in each evaluation", at_least(1))
    log_interval: int = option(10, "steps between reads of the loss from the device (and log lines, into a file)", at_least(1))
    out_dir: str = option("", "where logs and checkpoints go; '' = out/<config>-<attn>[-sft-<dataset>]")
    init_from: str = option("scratch", "scratch | resume (out_dir/ckpt_last.pt) | path/to/ckpt.pt (e.g. a transformer to convert)")
    overwrite: bool = option(False, "true = replace the run already in out_dir (its log and checkpoints are deleted)")
    keep_steps: str = option("", "steps (e.g. 100,250) whose weights are kept: ckpt_<step>.pt", (
        lambda v: not v or all(s.isdigit() for s in v.split(",")), "must be steps: 100,250"))
    seed: int = option(1337, "seeds the weights, the batches and the dropout")
    device: str = option("auto", "auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps")
    dtype: str = option("auto", "auto (bf16 where supported, else fp32) | float32 | bfloat16", one_of("auto", "float32", "bfloat16"))
    compile: bool = option(False, "torch.compile each block (orthros.compile_blocks)")
    fsdp: bool = option(False, "under torchrun: shard weights, gradients and optimizer state (FSDP2) instead of DDP")
    activation_checkpointing: bool = option(False, "with --fsdp: recompute each block's activations in the backward pass")


CONFIGS = {  # named presets: each sets only what differs from the defaults above
    # About 17 s on 2 CPU cores, start-up and evaluations included: enough to watch the loss fall.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, window=32, seq_len=128, batch_size=16,
                 max_iters=150, lr=3e-3, warmup_iters=10, eval_interval=50, eval_iters=5),
    # A GPU command: about 2 minutes on one H200 (hours on a CPU). Head dim 64, window 128 as in the paper.
    "small": dict(),
    # nanoGPT's shakespeare_char benchmark (its config/train_shakespeare_char.py): one GPU, minutes.
    "shakespeare_char": dict(dataset="shakespeare_char", seq_len=256, batch_size=64, max_iters=5000,
                             dropout=0.2, beta2=0.99, eval_iters=200),
    # The recall task (data/recall), SFT from scratch, window 128: 1-2 minutes on one H200.
    "recall": dict(task="sft", dataset="recall", n_layer=2, n_head=4, n_embd=64, window=128, conv_kernel=3,
                   seq_len=2200, batch_size=32, max_iters=3600, lr=3e-3, warmup_iters=50, eval_interval=400,
                   eval_iters=5, curriculum="train_short", curriculum_frac=0.75, weight_decay=0.0),
    # The same at window 32 (data/recall_tiny): 3-4 minutes on 2 idle CPU cores.
    "recall_tiny": dict(task="sft", dataset="recall_tiny", n_layer=2, n_head=4, n_embd=64, window=32, curriculum_frac=0.75,
                        conv_kernel=3, seq_len=384, batch_size=32, max_iters=2400, lr=3e-3, warmup_iters=50,
                        eval_interval=200, eval_iters=5, curriculum="train_short", weight_decay=0.0),
    # One layer, window 16, 40-token contexts (data/recall_micro): about half a minute on one CPU core.
    "recall_micro": dict(task="sft", dataset="recall_micro", n_layer=1, n_head=2, n_embd=64, window=16, conv_kernel=2,
                         seq_len=56, batch_size=64, max_iters=600, lr=5e-3, warmup_iters=50, eval_interval=150, eval_iters=2,
                         curriculum="train_short", curriculum_frac=0.67, weight_decay=0.0),
}
PRETRAINED_LR = 1e-4  # --init_from hf:DIR: a tenth of small's, as the paper continues its conversions at a tenth of its lr


def fail(message):  # stop with one line on stderr: what is wrong and what to do
    raise SystemExit(f"error: {message}")


# -----------------------------------------------------------------------------
# The command line, generated from TrainConfig

def value_parser(typ):
    """The argparse type of a field, with errors that read 'takes an integer, got ...'."""
    def parse(value):
        try:
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()] if typ is bool else typ(value)
        except (KeyError, ValueError):
            words = {bool: "true or false", int: "an integer", float: "a float"}.get(typ, "a string")
            raise argparse.ArgumentTypeError(f"takes {words}, got {value!r}") from None
    return parse


def parse_args(argv):
    """--config NAME plus --key value overrides -> (config name, TrainConfig), every value checked. --help
    lists every field of TrainConfig with its help, and what each named config sets."""
    presets = "\n".join(f"  {name:<12} " + (" ".join(f"{k}={v}" for k, v in preset.items()) or "the defaults below")
                        for name, preset in CONFIGS.items())
    parser = ArgumentParser(prog="python train.py", description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"named configs (--config NAME; each sets only what it lists):\n{presets}")
    parser.add_argument("--config", choices=CONFIGS, help="a named preset (default: small)")
    for f in fields(TrainConfig):
        parser.add_argument(f"--{f.name}", type=value_parser(f.type), default=argparse.SUPPRESS, metavar=f.type.__name__.upper(),
                            help=f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%"))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        key = unknown[0].split("=")[0]
        fail((f"unknown option {key}" if key.startswith("--") else f"expected --key value, got {unknown[0]!r}")
             + "; python train.py --help lists every option")
    values = vars(args)
    start = values.get("init_from", "scratch")  # from a checkpoint, its shape runs, not small's
    name = (given := values.pop("config")) or ("small" if start == "scratch" else None)
    if given is None and start == "scratch" and not torch.cuda.is_available():
        print("note: no --config: running small, a GPU config (hours on a CPU); --config tiny is the laptop's")
    cfg = TrainConfig(**{**CONFIGS.get(name, {}), **values})
    if not cfg.out_dir:  # out/<config>-<attn>[-noso]; SFT on a pre-training config adds -sft-<dataset>
        noso = "-noso" if cfg.attn == "orthros" and not cfg.scale_offset else ""
        cfg.out_dir = f"out/{name or 'small'}-{cfg.attn}{noso}"
        if cfg.task != CONFIGS.get(name, {}).get("task", "pretrain"):
            cfg.out_dir += f"-{cfg.task}-{Path(cfg.dataset).name or 'data'}"
    if start == "resume":
        name, cfg = resumed(cfg, values)
    for f in fields(cfg):
        if f.metadata["check"] and not f.metadata["check"][0](getattr(cfg, f.name)):
            fail(f"--{f.name} {f.metadata['check'][1]}, got {getattr(cfg, f.name)!r}")
    if cfg.max_seq_len and cfg.max_seq_len < cfg.seq_len:
        fail(f"--max_seq_len ({cfg.max_seq_len}) must be 0 or >= --seq_len ({cfg.seq_len})")
    if cfg.init_from.startswith("hf:") and "lr" not in values:  # a preset's lr is tuned from scratch (small's raised
        cfg.lr = PRETRAINED_LR                                      # SmolLM2-135M's loss): a pretrained model takes less
        if os.environ.get("RANK", "0") == "0":  # not once per process under torchrun
            print(f"note: lr {cfg.lr} (train.PRETRAINED_LR), not the {name or 'default'} preset's, "
                  "for a pretrained model; --lr sets another")
    return name, cfg


def resumed(cfg, given):
    """--init_from resume: (its config name, the TrainConfig the run saved in out_dir/ckpt_last.pt,
    with the options given on this command line over it); a note names those that change it."""
    try:
        ckpt = load_start("resume", cfg.out_dir, mmap=True)  # mmap: the config, not the weights
    except ValueError as e:
        fail(str(e))
    saved = {k: v for k, v in ckpt.get("train_config", {}).items() if k in dataclasses.asdict(cfg)}
    changed = [f"--{k} {v} (was {saved[k]!r})" for k, v in given.items()
               if k not in ("init_from", "out_dir", "overwrite") and v != saved.get(k, v)]
    if changed and os.environ.get("RANK", "0") == "0":
        print(f"note: resuming {cfg.out_dir}/ckpt_last.pt with its run's options, "
              f"but {', '.join(changed)}")
    kept = {"out_dir": cfg.out_dir, "overwrite": cfg.overwrite, "init_from": "resume"}
    restored = {**dataclasses.asdict(cfg), **saved, **given, **kept}
    return ckpt.get("config_name"), TrainConfig(**restored)


# -----------------------------------------------------------------------------
# The model, the schedule

def build_model(config_name, cfg, ckpt, vocab_size):
    """The model from scratch, resumed, or initialised from another checkpoint's weights."""
    chosen = dict(attn=cfg.attn, window=cfg.window, scale_offset=cfg.scale_offset, dropout=cfg.dropout)
    max_len = cfg.max_seq_len or cfg.seq_len
    preset = TrainConfig(**CONFIGS.get(config_name, {}))
    shape = ("n_layer", "n_head", "n_embd", "conv_kernel")
    if ckpt is None:
        model_args = dict(vocab_size=vocab_size, max_seq_len=max_len, **{k: getattr(cfg, k) for k in shape}, **chosen)
    elif cfg.init_from == "resume":
        model_args = ckpt["model_config"]
    else:  # the checkpoint's shape; attn, window, scale-offset from this run: transformer -> orthros is the conversion
        model_args = {**ckpt["model_config"], **chosen}
        model_args["max_seq_len"] = max(model_args["max_seq_len"], max_len)
    ignored = [f"--{k} {getattr(cfg, k)}" for k in shape if getattr(cfg, k) not in (getattr(preset, k), model_args[k])]
    if ignored:  # asked for (not the preset's value), and not the checkpoint's
        print(f"note: {', '.join(ignored)} ignored: the checkpoint's shape wins ({', '.join(f'{k}={model_args[k]}' for k in shape)})")
    for k in shape:  # the config printed and saved shows the model's real shape, not the preset's
        setattr(cfg, k, model_args[k])
    try:
        model = Orthros(OrthrosConfig(**model_args))
        if ckpt is not None:
            (model.load_state_dict if cfg.init_from == "resume" else model.load_transformer_weights)(ckpt["model"])
    except ValueError as e:  # an impossible model; weights of another model
        fail(f"--init_from {cfg.init_from}: {e}" if ckpt is not None else str(e))
    return model


def lr_at(step, cfg):
    """Linear warmup, then cosine decay from lr to min_lr_ratio * lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def shard(model, activation_checkpointing, bf16):
    """FSDP2, in place: each Block, then the rest, becomes a unit whose weights, gradients and optimizer state are split over
    the processes, gathered only while it runs; bf16 compute, float32 gradient reduction; checkpointing recomputes activations."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        if activation_checkpointing:  # the module stays a Block: its state dict keeps its names
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


# -----------------------------------------------------------------------------
# The run: Run reads and checks everything (writing nothing), then train() is the loop; Ctrl-C saves

class StopRequest:
    """While the run writes: SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current step (under torchrun,
    at the next log step) and save ckpt_last.pt. A second Ctrl-C stops at once (KeyboardInterrupt), without saving;
    a repeated SIGTERM just waits. Before it, Ctrl-C ends the run the way Python does: nothing is written yet."""

    def __enter__(self):
        self.asked = self.signal = None  # asked: on this process; signal: the stop the processes agreed on, at a read
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.asked is None:
            self.asked = signal.Signals(signum).name
            tqdm.write(f"{self.asked}: stopping after this step (torchrun: the next log step) and saving; Ctrl-C again: at once, unsaved")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

class Run:
    """A run's state: device and DDP rank, data, model, optimizer, step, and its out_dir."""

    def __init__(self, config_name, cfg):
        self.config_name, self.cfg, self.out_dir = config_name, cfg, Path(cfg.out_dir)
        self.ddp = "RANK" in os.environ  # set by torchrun: DDP, or FSDP with --fsdp
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.master, self.fsdp = self.rank == 0, self.ddp and cfg.fsdp  # rank 0 logs and saves
        if not self.ddp and (cfg.fsdp or cfg.activation_checkpointing):
            print("note: --fsdp and --activation_checkpointing act only under torchrun; one process trains as usual")
        # Our own errors (bad options, missing data, a foreign checkpoint, a missing package): one line; CUDA's, NCCL's: a traceback.
        try:
            self.device = pick_device(cfg.device)
            if self.ddp and self.device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
                torch.cuda.set_device(self.device)
            if self.ddp:
                dist.init_process_group(backend="nccl" if self.device.startswith("cuda") else "gloo")
            self.data_dir = find_dataset(cfg.dataset, prepare=self.master)  # rank 0 prepares the data once
            if self.ddp:
                dist.barrier()
            meta = load_meta(self.data_dir) if (self.data_dir / "meta.json").exists() else {}
            self.init_ckpt = ckpt = load_start(cfg.init_from, cfg.out_dir)
            # The tokenizer: the dataset's, else the checkpoint's, else bytes. They must agree.
            self.tokenizer_name = meta.get("tokenizer") or (ckpt or {}).get("tokenizer") or "byte"
            if ckpt is not None and ckpt["tokenizer"] != self.tokenizer_name:
                fail(f"the checkpoint uses the {ckpt['tokenizer']!r} tokenizer but the dataset {self.tokenizer_name!r}; "
                     "a model only understands the tokenizer it was trained with")
            files = (ckpt or {}).get("tokenizer_files")  # an hf: checkpoint's own copy
            self.tokenizer = tokenizer = get_tokenizer(self.tokenizer_name, files)
            if cfg.data_order == "epoch" and cfg.task != "pretrain":
                fail("--data_order epoch is for pre-training; SFT draws its examples at random")
            pretrain = lambda: PretrainBatches(self.data_dir, cfg.seq_len, self.device,
                                               cfg.data_order, cfg.seed)
            self.batches = (pretrain() if cfg.task == "pretrain" else
                            SFTBatches(self.data_dir, tokenizer, cfg.seq_len, cfg.sft_overlong, cfg.curriculum,
                                       self.device, log=self.print))
            claim_out_dir(cfg.out_dir, cfg.init_from, cfg.overwrite)
        except (ValueError, FileNotFoundError, UnicodeDecodeError, ImportError) as e:
            fail(str(e).splitlines()[0])
        self.device_type, self.peak_flops = torch.device(self.device).type, peak_flops(self.device)
        bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device_type == "cuda" and torch.cuda.is_bf16_supported())
        self.ctx = torch.autocast(self.device_type, dtype=torch.bfloat16) if bf16 and not self.fsdp else nullcontext()
        self.precision = ("bfloat16" + (" (FSDP)" if self.fsdp else " autocast")) if bf16 else "float32"
        torch.manual_seed(cfg.seed)
        self.raw_model = build_model(config_name, cfg, ckpt, tokenizer.vocab_size).to(self.device)
        if self.fsdp:
            shard(self.raw_model, cfg.activation_checkpointing, bf16)
        decay = [p for p in self.raw_model.parameters() if p.dim() == 2]  # matrices; not norms, scale-offsets, conv
        rest = [p for p in self.raw_model.parameters() if p.dim() != 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                                           lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=self.device_type == "cuda" and not self.fsdp)
        self.train_gen = torch.Generator().manual_seed(cfg.seed)  # draws the training batches
        self.step, self.best_val = 0, float("inf")
        if ckpt is not None and cfg.init_from == "resume":
            restore_training_state(ckpt, self.raw_model, self.optimizer, self.train_gen, sharded=self.fsdp)
            self.step, self.best_val = ckpt["step"], ckpt["best_val_loss"]
        self.start_step, self.saved, self.log_file = self.step, {}, None  # saved: checkpoint name -> step

    def print(self, *args):
        if self.master:
            tqdm.write(" ".join(map(str, args)))  # above the progress bar, if there is one

    def log(self, *records):
        if self.master:
            print(*map(json.dumps, records), sep="\n", file=self.log_file, flush=True)

    def checkpoint(self, best=False):
        """Save everything a resume needs into ckpt_last.pt (with best, ckpt_best.pt becomes the same file: one write, not
        two). Every rank calls it: under FSDP the full (unsharded) states are gathered to rank 0, which writes them."""
        state = training_state(self.raw_model, self.optimizer, self.train_gen)
        self.saved.update({"ckpt_last.pt": self.step, **({"ckpt_best.pt": self.step} if best else {})})
        if not self.master:
            return
        save_checkpoint(self.out_dir / "ckpt_last.pt", **state, step=self.step, best_val_loss=self.best_val,
                        model_config=dataclasses.asdict(self.raw_model.config), train_config=dataclasses.asdict(self.cfg),
                        config_name=self.config_name, tokenizer=self.tokenizer_name, dataset=self.cfg.dataset,
                        tokenizer_files=getattr(self.tokenizer, "files", None))  # hf:'s only
        if best:
            link_best(self.out_dir)

    def keep_weights(self):
        """--keep_steps: this step's weights alone (no optimizer state), in ckpt_<step>.pt. Every
        rank calls it: under FSDP the full weights are gathered to rank 0, which writes them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.raw_model, options=full)
        if self.master:
            save_checkpoint(self.out_dir / f"ckpt_{self.step}.pt", model=weights, step=self.step,
                            model_config=dataclasses.asdict(self.raw_model.config),
                            train_config=dataclasses.asdict(self.cfg),
                            tokenizer=self.tokenizer_name)

    @torch.no_grad()
    def evaluate(self):
        """The mean loss over eval_iters batches per split, the same batches every time (a fixed seed); once training has
        started (a run from a checkpoint's weights: at step 0 too, so that ckpt_best.pt is never worse than its start), save."""
        cfg, model, losses = self.cfg, self.raw_model.eval(), {}
        bar = tqdm(total=2 * cfg.eval_iters, desc=f"eval at step {self.step}", leave=False, disable=None)  # on a terminal
        for split in ("train", "val"):
            gen, total = torch.Generator().manual_seed(cfg.seed + 1), 0.0
            for _ in range(cfg.eval_iters):
                x, y, t_out = self.batches.get(split, cfg.batch_size, gen)
                with self.ctx:
                    total += model(x, y, t_out=t_out)[1].item() / cfg.eval_iters
                bar.update(1)
            losses[split] = total
        bar.close()
        model.train()
        self.log({"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
        self.print(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if self.step > self.start_step or self.cfg.init_from not in ("scratch", "resume"):
            improved, self.best_val = losses["val"] < self.best_val, min(losses["val"], self.best_val)
            self.checkpoint(best=improved)

    def train_step(self, model):
        """One optimizer step (grad_accum micro-steps). Returns its log record, the loss and gradient norm still on the device."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        split = cfg.curriculum if cfg.curriculum and self.step < cfg.curriculum_frac * cfg.max_iters else "train"
        # Every rank draws the same global batches and keeps its slice of each. The loss is the mean over all their targets,
        # a count every rank knows: each slice adds its loss sum over it, times world against DDP's (FSDP's) gradient average.
        # So SFT responses of any lengths give the same step on any number of processes and micro-steps.
        size, epoch = cfg.batch_size * self.world, cfg.data_order == "epoch"
        first = lambda m: {"first": (self.step * cfg.grad_accum + m) * size} if epoch else {}
        batches = [self.batches.get(split, size, self.train_gen, **first(m))
                   for m in range(cfg.grad_accum)]
        n_targets = sum((y != IGNORE).sum() for _, y, _ in batches).clamp(min=1)  # on the device: nothing waits
        mine = slice(self.rank * cfg.batch_size, (self.rank + 1) * cfg.batch_size)
        loss_sum, n_tokens, flops, out_share = torch.zeros((), device=self.device), 0, 0, 0.0
        for micro, (x, y, t_out) in enumerate(batches):
            x, y = x[mine], y[mine]
            n_tokens += x.numel() * self.world
            flops += 3 * x.size(0) * forward_flops(self.raw_model.config, x.size(1), t_out)  # this process's: forward + backward
            out_share += t_out / x.size(1) / cfg.grad_accum  # 1.0 in pre-training; SFT runs T + t_out, not 2T
            sync_grads = not self.ddp or micro == cfg.grad_accum - 1
            if self.fsdp:
                model.set_requires_gradient_sync(sync_grads)
            with self.ctx, (nullcontext() if sync_grads or self.fsdp else model.no_sync()):
                _, loss = model(x, y, t_out=t_out)
                share = loss * (y != IGNORE).sum() / n_targets  # this slice's loss sum over the global count
                (share * self.world).backward()
            loss_sum += share.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": loss_sum, "lr": lr, "grad_norm": grad_norm.full_tensor() if self.fsdp else grad_norm,
                "tokens": n_tokens, "flops": flops, "t_out_share": out_share}  # under FSDP grad_norm is a DTensor

    def read(self, records, t_start, stop):
        """The CPU's one wait for the device per interval: log the steps' losses and gradient norms, stop at a non-finite loss,
        put the interval's speed on the last record (returned), and (under torchrun) agree on a stop request."""
        values = torch.stack([*(r["loss"] for r in records), torch.tensor(float(stop.asked is not None), device=self.device)])
        if self.ddp:  # each rank holds its targets' share of each loss, and its own stop flag
            dist.all_reduce(values)
        sync(self.device)  # the clock then measures the work done, not the work queued
        seconds, (*losses, stops) = time.perf_counter() - t_start, values.tolist()
        stop.signal = (stop.asked or "a stop request on another rank") if stops else None  # the same on every rank
        for record, loss, grad_norm in zip(records, losses, torch.stack([r["grad_norm"] for r in records]).tolist()):
            if not math.isfinite(loss):
                last = (f"the last good checkpoint ({self.out_dir}/ckpt_last.pt, step {self.saved['ckpt_last.pt']}) is untouched"
                        if "ckpt_last.pt" in self.saved else "no checkpoint had been written yet")
                fail(f"the training loss is {loss} at step {record['step']} (read at step {self.step}). Stopping; {last}. "
                     "Try a lower --lr, or --dtype float32.")
            record.update(loss=loss, grad_norm=grad_norm)
        record.update(ms_per_step=1000 * seconds / len(records), tok_per_s=sum(r.pop("tokens") for r in records) / seconds,
                      **({"mfu": sum(r["flops"] for r in records) / seconds / self.peak_flops} if self.peak_flops else {}),
                      **({"max_memory_gb": torch.cuda.max_memory_allocated() / 1e9} if self.device_type == "cuda" else {}))
        self.log(*records)
        return record


def train(run, argv):
    """Claim out_dir, then the loop: evaluate every eval_interval steps; stop at max_iters or when asked."""
    cfg = run.cfg
    what = f"config {run.config_name}" if run.config_name else "no --config: the defaults"
    if cfg.init_from not in ("scratch", "resume"):
        what += f", the model of {cfg.init_from}"  # its shape, listed
    run.print(f"{what}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
    run.print(f"model: {sum(p.numel() for p in run.raw_model.parameters()) / 1e6:.2f}M parameters, {run.raw_model.config}")
    run.print(f"device {run.device} ({run.precision}), world size {run.world}, data {run.data_dir} ({run.tokenizer_name} "
              f"tokenizer)" + (f"; initialised from {cfg.init_from}" if run.init_ckpt else "") + (f" at step {run.step}" if run.step else ""))
    model = compile_blocks(run.raw_model) if cfg.compile and compile_works(run.device) else run.raw_model
    if run.ddp and not run.fsdp:
        model = DDP(model, device_ids=[int(run.device.split(":")[1])] if run.device_type == "cuda" else None)
    if run.ddp:
        dist.barrier()  # every rank has checked out_dir (in Run) before rank 0 writes into it
    with StopRequest() as stop:  # from the first write on, Ctrl-C saves
        run.log_file = open_log(cfg.out_dir, cfg.init_from == "resume", cfg.overwrite, run.step) if run.master else None
        if run.step == 0:  # every rank evaluates (under FSDP a forward needs them all); rank 0 logs
            run.evaluate()
        bar = tqdm(total=cfg.max_iters, initial=run.step, disable=None if run.master else True, unit="step", dynamic_ncols=True)
        t_start, unread = time.perf_counter(), []
        while run.step < cfg.max_iters:
            unread.append(run.train_step(model))
            bar.update(1)
            if str(run.step) in cfg.keep_steps.split(","):
                run.keep_weights()
            evaluating = run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters
            # The CPU waits for the device only every log_interval steps, before an evaluation (a non-finite loss must
            # stop the run before it saves) and on a stop request; in between it queues the next steps while the GPU runs.
            if run.step % cfg.log_interval and not evaluating and not (stop.asked and not run.ddp):
                continue
            record, unread = run.read(unread, t_start, stop), []
            share = f", t_out/T {record['t_out_share']:.2f}" if cfg.task == "sft" else ""  # of the positions, in the output stream
            line = (f"loss {record['loss']:.4f}, {record['ms_per_step']:.1f} ms/step, {record['tok_per_s']:,.0f} tok/s{share}"
                    + (f", MFU {record['mfu']:.1%}" if "mfu" in record else ""))
            if not bar.disable:
                bar.set_postfix_str(line)
            elif run.step % cfg.log_interval == 0:
                run.print(f"step {run.step}: {line}")
            if stop.signal is not None:
                break
            if evaluating:
                run.evaluate()
            t_start = time.perf_counter()  # after the eval: the steps are timed alone
        bar.close()
        if run.saved.get("ckpt_last.pt") != run.step:
            run.checkpoint()  # after a stop request, and for --max_iters 0
    if stop.signal is not None:
        run.print(f"stopped by {stop.signal} after step {run.step}; saved {run.out_dir}/ckpt_last.pt. "
                  f"Resume with: {resume_command(argv)}")
        raise SystemExit(130)


def sft_report(run):
    """What the T_in/T_out split saved, and the exact-match accuracy on test.jsonl if there is one."""
    shares = [r["t_out_share"] for r in map(json.loads, open(run.out_dir / "log.jsonl")) if "t_out_share" in r] if run.master else []
    if shares:
        run.print(f"SFT: the output stream covered {sum(shares) / len(shares):.1%} of the positions on average: the "
                  f"T_in/T_out split saved {1 - sum(shares) / len(shares):.1%} of the output-token work against t_out = T")
    if not (run.master or run.fsdp):  # under FSDP every rank takes part in each forward
        return

    def greedy(prompts, n_new):  # through the model's KV cache
        idx = torch.tensor(prompts, device=run.device)
        with run.ctx:
            return run.raw_model.eval().generate(idx, n_new, temperature=0)[:, idx.size(1):].tolist()
    scores = exact_match_report(run.batches.examples.get("test", []), greedy, run.cfg.eval_exact_match, log=run.print)
    if scores and run.master:
        run.log({"step": run.step, "exact_match": scores})
        atomic_write(run.out_dir / "exact_match.json", lambda f: f.write(json.dumps(scores, indent=2) + "\n"), mode="w")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config_name, cfg = parse_args(argv)
    run = Run(config_name, cfg)  # reads and checks everything; writes nothing
    try:
        if cfg.init_from == "resume" and run.step >= cfg.max_iters:  # a finished run: write nothing, not even its log
            return run.print(f"nothing to do: {run.out_dir} is at step {run.step} of --max_iters {cfg.max_iters}; raise it to train on")
        train(run, argv)
        if cfg.task == "sft":
            sft_report(run)
    finally:
        if run.log_file is not None:
            run.log_file.close()
        if run.ddp:
            dist.destroy_process_group()
    if run.master:
        best = (f"best val loss {run.best_val:.4f} (ckpt_best.pt, " + (f"step {run.saved['ckpt_best.pt']})" if "ckpt_best.pt" in run.saved
                else "before this resume)") if math.isfinite(run.best_val) else "no evaluation after training started, so no ckpt_best.pt")
        print(f"done: {run.step} steps; {best}; ckpt_last.pt at step {run.step}; in {run.out_dir}/")
    return run.best_val


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a second Ctrl-C in the loop
        sys.exit("\ninterrupted: stopped at once; checkpoints already in out_dir are whole (they are written atomically)")
