r"""
Train Orthros, or a baseline, on one GPU, on CPU, or on several GPUs with torchrun.

    python train.py --config tiny                        # 2 CPU cores: 150 steps, about 17 s in all
    python train.py --config small                       # one GPU: about 2 minutes on an H200
    python train.py --config small --attn transformer    # the baselines: transformer | swa
    python train.py --config small --scale_offset false  # the paper's "w/o SO" ablation
    python train.py --config shakespeare_char            # nanoGPT's character-level benchmark
    python train.py --config small --init_from resume    # continue out_dir's run (ckpt_last.pt)
    python train.py --config tiny --task sft --dataset data/sft_example \
        --init_from out/tiny-orthros/ckpt_best.pt        # SFT from a pre-trained checkpoint
    torchrun --standalone --nproc_per_node=2 train.py --config small    # DistributedDataParallel
    torchrun --standalone --nproc_per_node=8 train.py ... --fsdp true   # sharded weights (FSDP2)

Pre-training trains every position (t_out = T); SFT only the responses, with the smallest t_out
that covers them (data/sft.py). A run never writes over another run's files; Ctrl-C stops after
the step and saves ckpt_last.pt. A terminal shows a progress bar, a file one line per log_interval.
"""

import functools
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import (BELOW_ONE, FRACTION, ArgumentParser, StopRequest, at_least, check_options,
                        claim_out_dir, compile_works, fail, link_best, load_start, note, one_of,
                        open_log, option, parse_options, pick_device, restore_training_state,
                        resume_command, resumed, save_checkpoint, sync, training_state)
from data.prepare_utils import PretrainBatches, atomic_write, find_dataset, load_meta
from data.sft import SFTBatches, exact_match_report
from data.tokenizer import get_tokenizer
from orthros import IGNORE, Orthros, OrthrosConfig, compile_blocks
from perf.flops import forward_flops, peak_flops


@dataclass
class TrainConfig:
    # data
    task: str = option("pretrain", "pretrain | sft (responses only)", one_of("pretrain", "sft"))
    dataset: str = option("stdlib", "a name in data/ (prepared on first use), or a folder path")
    sft_overlong: str = option("drop", "SFT examples over seq_len: drop | truncate (oldest tokens)",
                               one_of("drop", "truncate"))
    data_order: str = option("random", "pretrain: random windows (nanoGPT's) | epoch (disjoint "
                             "windows, each once per epoch)", one_of("random", "epoch"))
    curriculum: str = option("", "SFT: a split (e.g. train_short) for the first curriculum_frac")
    curriculum_frac: float = option(0.5, "SFT: the share of steps on the curriculum", FRACTION)
    eval_exact_match: int = option(-1, "SFT: test examples scored at end (-1 = all)", at_least(-1))
    # model: OrthrosConfig in orthros.py
    attn: str = option("orthros", "orthros | transformer | swa")
    scale_offset: bool = option(True, "false = the paper's 'Orthros w/o SO' ablation")
    window: int = option(128, "w, the sliding window (the paper uses 128)")
    n_layer: int = option(6, "layers")
    n_head: int = option(6, "attention heads (n_embd / n_head must be even)")
    n_embd: int = option(384, "model width C")
    dropout: float = option(0.0, "dropout on embeddings, attention and residuals", BELOW_ONE)
    conv_kernel: int = option(0, "a short convolution before K and V (not in the paper; 0 = off)")
    seq_len: int = option(1024, "T, tokens per training sequence", at_least(1))
    max_seq_len: int = option(0, "longest sequence the model accepts; 0 = seq_len", at_least(0))
    # optimization: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    batch_size: int = option(16, "sequences per micro-step (per GPU under torchrun)", at_least(1))
    grad_accum: int = option(1, "micro-steps per optimizer step", at_least(1))
    max_iters: int = option(2000, "optimizer steps (0: save the initial model)", at_least(0))
    lr: float = option(1e-3, "peak learning rate (from hf:DIR: PRETRAINED_LR = 1e-4)", at_least(0))
    min_lr_ratio: float = option(0.1, "the final learning rate, as a fraction of lr", FRACTION)
    warmup_iters: int = option(100, "steps of linear warmup", at_least(0))
    weight_decay: float = option(0.1, "AdamW weight decay, on matrices only", at_least(0))
    beta1: float = option(0.9, "AdamW beta1", BELOW_ONE)
    beta2: float = option(0.95, "AdamW beta2", BELOW_ONE)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0 = off)", at_least(0))
    # evaluation, logging, checkpoints
    eval_interval: int = option(250, "evaluate and checkpoint every this many steps", at_least(1))
    eval_iters: int = option(20, "batches per split in each evaluation", at_least(1))
    log_interval: int = option(10, "steps between loss reads (and log-file lines)", at_least(1))
    out_dir: str = option("", "logs and checkpoints; '' = out/<config>-<attn>[-sft-<dataset>]")
    init_from: str = option("scratch", "scratch | resume (out_dir's run) | a ckpt.pt | hf:DIR")
    overwrite: bool = option(False, "true = replace the run in out_dir (its files are deleted)")
    keep_steps: str = option("", "steps (e.g. 100,250) whose weights are kept: ckpt_<step>.pt", (
        lambda v: not v or all(s.isdigit() for s in v.split(",")), "must be steps: 100,250"))
    seed: int = option(1337, "seeds the weights, the batches and the dropout")
    device: str = option("auto", "auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N | mps")
    dtype: str = option("auto", "auto (bf16 where supported, else fp32) | float32 | bfloat16",
                        one_of("auto", "float32", "bfloat16"))
    compile: bool = option(False, "torch.compile each block (orthros.compile_blocks)")
    fsdp: bool = option(False, "under torchrun: shard the model and optimizer (FSDP2), not DDP")
    activation_checkpointing: bool = option(False, "with --fsdp: recompute activations backward")


RECALL = dict(task="sft", n_layer=2, n_head=4, n_embd=64, conv_kernel=3, batch_size=32, lr=3e-3,
              warmup_iters=50, eval_iters=5, curriculum="train_short", curriculum_frac=0.75,
              weight_decay=0.0)  # the recall presets' shared settings
CONFIGS = {  # named presets: each sets only what differs from the defaults above
    # About 17 s on 2 CPU cores, start-up and evaluations included: enough to watch the loss fall.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, window=32, seq_len=128, batch_size=16,
                 max_iters=150, lr=3e-3, warmup_iters=10, eval_interval=50, eval_iters=5),
    # A GPU command: about 2 minutes on one H200 (hours on a CPU). Head dim 64, window 128.
    "small": dict(),
    # nanoGPT's shakespeare_char benchmark (its config/train_shakespeare_char.py): one GPU, minutes.
    "shakespeare_char": dict(dataset="shakespeare_char", seq_len=256, batch_size=64,
                             max_iters=5000, dropout=0.2, beta2=0.99, eval_iters=200),
    # The recall task (data/recall), SFT from scratch, window 128: 1-2 minutes on one H200.
    "recall": dict(RECALL, dataset="recall", window=128, seq_len=2200, max_iters=3600,
                   eval_interval=400),
    # The same at window 32 (data/recall_tiny): 3-4 minutes on 2 idle CPU cores.
    "recall_tiny": dict(RECALL, dataset="recall_tiny", window=32, seq_len=384, max_iters=2400,
                        eval_interval=200),
    # One layer, window 16, 40-token contexts (data/recall_micro): about half a minute on one core.
    "recall_micro": dict(RECALL, dataset="recall_micro", n_layer=1, n_head=2, window=16,
                         conv_kernel=2, seq_len=56, batch_size=64, max_iters=600, lr=5e-3,
                         eval_interval=150, eval_iters=2, curriculum_frac=0.67),
}
PRETRAINED_LR = 1e-4  # --init_from hf:DIR: a tenth of small's, as the paper's conversions


# -----------------------------------------------------------------------------
# The command line, generated from TrainConfig (checkpoint.parse_options)

def parse_args(argv):
    """--config NAME, --key value overrides -> (config name, TrainConfig), every value checked."""
    parser = ArgumentParser(prog="python train.py", description=__doc__, allow_abbrev=False)
    given = parse_options(parser, TrainConfig, argv, presets=CONFIGS)
    start = given.get("init_from", "scratch")  # from a checkpoint, its shape runs, not small's
    name = (config := given.pop("config")) or ("small" if start == "scratch" else None)
    if config is None and start == "scratch" and not torch.cuda.is_available():
        note("no --config: running small, a GPU config (hours on a CPU); a laptop's: --config tiny")
    cfg = TrainConfig(**{**CONFIGS.get(name, {}), **given})
    if not cfg.out_dir:  # out/<config>-<attn>[-noso]; SFT on a pre-training config: -sft-<dataset>
        noso = "-noso" if cfg.attn == "orthros" and not cfg.scale_offset else ""
        cfg.out_dir = f"out/{name or 'small'}-{cfg.attn}{noso}"
        if cfg.task != CONFIGS.get(name, {}).get("task", "pretrain"):
            cfg.out_dir += f"-{cfg.task}-{Path(cfg.dataset).name or 'data'}"
    if start == "resume":
        name, cfg = resumed(cfg, given)
    check_options(cfg)
    if cfg.max_seq_len and cfg.max_seq_len < cfg.seq_len:
        fail(f"--max_seq_len ({cfg.max_seq_len}) must be 0 or >= --seq_len ({cfg.seq_len})")
    if cfg.data_order == "epoch" and cfg.task != "pretrain":
        fail("--data_order epoch is for pre-training; SFT draws its examples at random")
    if start.startswith("hf:") and "lr" not in given:  # a preset's lr is tuned from scratch
        cfg.lr = PRETRAINED_LR
        note(f"lr {cfg.lr} (train.PRETRAINED_LR), not the {name or 'default'} preset's, for a "
             "pretrained model; --lr sets another")
    return name, cfg


def build_model(config_name, cfg, ckpt, vocab_size):
    """The model from scratch, resumed, or initialised from another checkpoint's weights."""
    chosen = {k: getattr(cfg, k) for k in ("attn", "window", "scale_offset", "dropout")}
    shape, max_len = ("n_layer", "n_head", "n_embd", "conv_kernel"), cfg.max_seq_len or cfg.seq_len
    if ckpt is None:
        args = dict(vocab_size=vocab_size, max_seq_len=max_len, **chosen,
                    **{k: getattr(cfg, k) for k in shape})
    elif cfg.init_from == "resume":
        args = ckpt["model_config"]
    else:  # the checkpoint's shape, this run's attn, window, scale-offset
        args = {**ckpt["model_config"], **chosen}
        args["max_seq_len"] = max(args["max_seq_len"], max_len)
    preset = TrainConfig(**CONFIGS.get(config_name, {}))
    ignored = [f"--{k} {getattr(cfg, k)}" for k in shape  # asked for, and not the checkpoint's
               if getattr(cfg, k) not in (getattr(preset, k), args[k])]
    if ignored:
        note(f"{', '.join(ignored)} ignored: the checkpoint's shape wins "
             f"({', '.join(f'{k}={args[k]}' for k in shape)})")
    for k in shape:  # the config printed and saved shows the model's real shape, not the preset's
        setattr(cfg, k, args[k])
    try:
        model = Orthros(OrthrosConfig(**args))
        if ckpt is not None:  # transformer -> orthros: the paper's conversion (section 4.3)
            resume = cfg.init_from == "resume"
            (model.load_state_dict if resume else model.load_transformer_weights)(ckpt["model"])
    except ValueError as e:  # an impossible model; weights of another model
        fail(f"--init_from {cfg.init_from}: {e}" if ckpt is not None else str(e))
    return model


def lr_at(step, cfg):
    """Linear warmup, then cosine decay from lr to min_lr_ratio * lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def shard(model, activation_checkpointing, bf16):
    """FSDP2, in place: each Block, then the rest, split over the processes, whole as it runs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    for block in model.blocks:
        if activation_checkpointing:  # the module stays a Block: its state dict keeps its names
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                              use_reentrant=False)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


# -----------------------------------------------------------------------------
# The run: Run reads and checks everything (writing nothing), then train() is the loop

class Run:
    """A run's state: processes and device, data, model, optimizer, step, and its out_dir."""

    def __init__(self, config_name, cfg):
        self.config_name, self.cfg, self.out_dir = config_name, cfg, Path(cfg.out_dir)
        self.ddp = "RANK" in os.environ  # set by torchrun: DDP, or FSDP with --fsdp
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.master, self.fsdp = self.rank == 0, self.ddp and cfg.fsdp  # rank 0 logs and saves
        if not self.ddp and (cfg.fsdp or cfg.activation_checkpointing):
            note("--fsdp and --activation_checkpointing act only under torchrun; ignored")
        try:  # our errors (data, a foreign checkpoint, a package): one line; CUDA's: a traceback
            ckpt = self.load()
        except (ValueError, FileNotFoundError, UnicodeDecodeError, ImportError) as e:
            fail(str(e).splitlines()[0])
        self.device_type, self.peak_flops = torch.device(self.device).type, peak_flops(self.device)
        cuda = self.device_type == "cuda"
        bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda
                                           and torch.cuda.is_bf16_supported())
        autocast = bf16 and not self.fsdp  # FSDP casts for itself
        self.ctx = torch.autocast(self.device_type, torch.bfloat16) if autocast else nullcontext()
        self.precision = f"bfloat16 {'autocast' if autocast else '(FSDP)'}" if bf16 else "float32"
        torch.manual_seed(cfg.seed)
        self.raw_model = build_model(config_name, cfg, ckpt, self.tokenizer.vocab_size)
        self.raw_model.to(self.device)
        if self.fsdp:
            shard(self.raw_model, cfg.activation_checkpointing, bf16)
        params = list(self.raw_model.parameters())  # decay matrices; not norms, scale-offsets, conv
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() == 2], "weight_decay": cfg.weight_decay},
             {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=cuda and not self.fsdp)
        self.train_gen = torch.Generator().manual_seed(cfg.seed)  # draws the training batches
        self.step, self.best_val = 0, float("inf")
        if cfg.init_from == "resume":
            restore_training_state(ckpt, self.raw_model, self.optimizer, self.train_gen, self.fsdp)
            self.step, self.best_val = ckpt["step"], ckpt["best_val_loss"]
        self.start_step, self.saved, self.log_file = self.step, {}, None  # saved: {file: step}

    def load(self):
        """Join the processes; read the data, tokenizer and checkpoint to start from (returned)."""
        cfg = self.cfg
        self.device = pick_device(cfg.device)
        if self.ddp and self.device.startswith("cuda"):
            self.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(self.device)
        if self.ddp:
            dist.init_process_group(backend="nccl" if self.device.startswith("cuda") else "gloo")
        self.data_dir = find_dataset(cfg.dataset, prepare=self.master)  # rank 0 prepares it once
        if self.ddp:
            dist.barrier()
        meta = load_meta(self.data_dir) if (self.data_dir / "meta.json").exists() else {}
        ckpt = load_start(cfg.init_from, cfg.out_dir)
        # The tokenizer: the dataset's, else the checkpoint's, else bytes. They must agree.
        self.tokenizer_name = meta.get("tokenizer") or (ckpt or {}).get("tokenizer") or "byte"
        if ckpt is not None and ckpt["tokenizer"] != self.tokenizer_name:
            raise ValueError(f"the checkpoint uses the {ckpt['tokenizer']!r} tokenizer, the data "
                             f"{self.tokenizer_name!r}; a model only understands its own")
        self.tokenizer = get_tokenizer(self.tokenizer_name, (ckpt or {}).get("tokenizer_files"))
        self.batches = (PretrainBatches(self.data_dir, cfg.seq_len, self.device, cfg.data_order,
                                        cfg.seed) if cfg.task == "pretrain" else
                        SFTBatches(self.data_dir, self.tokenizer, cfg.seq_len, cfg.sft_overlong,
                                   cfg.curriculum, self.device, log=self.print))
        claim_out_dir(cfg.out_dir, cfg.init_from, cfg.overwrite)  # before anything is written
        return ckpt

    def print(self, *args):
        if self.master:
            tqdm.write(" ".join(map(str, args)))  # above the progress bar, if there is one

    def log(self, *records):
        if self.master:
            print(*map(json.dumps, records), sep="\n", file=self.log_file, flush=True)

    def checkpoint(self, best=False, keep=False):
        """Save all that a resume needs in ckpt_last.pt (best: ckpt_best.pt is made the same file),
        or the weights alone (keep: --keep_steps) in ckpt_<step>.pt. Every rank calls it: FSDP
        gathers the full states on rank 0, which writes them."""
        state = training_state(self.raw_model, None if keep else self.optimizer, self.train_gen)
        name = f"ckpt_{self.step}.pt" if keep else "ckpt_last.pt"
        self.saved.update({name: self.step, **({"ckpt_best.pt": self.step} if best else {})})
        if self.master:
            save_checkpoint(self.out_dir / name, **state, step=self.step, dataset=self.cfg.dataset,
                            model_config=asdict(self.raw_model.config), best_val_loss=self.best_val,
                            train_config=asdict(self.cfg), config_name=self.config_name,
                            tokenizer=self.tokenizer_name,
                            tokenizer_files=getattr(self.tokenizer, "files", None))  # hf:'s
            if best:
                link_best(self.out_dir)  # one write, not two

    @torch.no_grad()
    def evaluate(self):
        """The mean loss over eval_iters batches per split, the same ones each time; then, once
        training has started (or from a checkpoint's weights: never worse than the start), save."""
        cfg, model, losses = self.cfg, self.raw_model.eval(), {"train": 0.0, "val": 0.0}
        for split in losses:
            gen = torch.Generator().manual_seed(cfg.seed + 1)
            for _ in tqdm(range(cfg.eval_iters), desc=f"eval {split}", leave=False, disable=None):
                x, y, t_out = self.batches.get(split, cfg.batch_size, gen)
                with self.ctx:
                    losses[split] += model(x, y, t_out=t_out)[1].item() / cfg.eval_iters
        model.train()
        train_loss, val_loss = losses["train"], losses["val"]
        self.log({"step": self.step, "train_loss": train_loss, "val_loss": val_loss})
        self.print(f"step {self.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
        if self.step > self.start_step or cfg.init_from not in ("scratch", "resume"):
            improved, self.best_val = val_loss < self.best_val, min(val_loss, self.best_val)
            self.checkpoint(best=improved)

    def train_step(self, model):
        """One optimizer step; its log record holds the loss and gradient norm, still on device."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        split = cfg.curriculum if self.step < cfg.curriculum_frac * cfg.max_iters else ""
        # Every rank draws the same global batches and keeps its slice of each. The loss is the
        # mean over all their targets: each slice adds its loss sum over that count, times world
        # against the gradients' mean. So SFT steps alike on any number of processes, micro-steps.
        size, epoch = cfg.batch_size * self.world, cfg.data_order == "epoch"
        at = self.step * cfg.grad_accum * size  # epoch: the next windows of the run's order
        batches = [self.batches.get(split or "train", size, self.train_gen,
                                    **({"first": first} if epoch else {}))
                   for first in range(at, at + cfg.grad_accum * size, size)]
        n_targets = sum((y != IGNORE).sum() for _, y, _ in batches).clamp(min=1)  # on the device
        mine = slice(self.rank * cfg.batch_size, (self.rank + 1) * cfg.batch_size)
        loss_sum, n_tokens, flops, out_share = torch.zeros((), device=self.device), 0, 0, 0.0
        for micro, (x, y, t_out) in enumerate(batches):
            x, y = x[mine], y[mine]
            n_tokens += x.numel() * self.world
            flops += 3 * x.size(0) * forward_flops(self.raw_model.config, x.size(1), t_out)  # f+b
            out_share += t_out / x.size(1) / cfg.grad_accum  # SFT runs T + t_out positions, not 2T
            sync_grads = not self.ddp or micro == cfg.grad_accum - 1
            if self.fsdp:
                model.set_requires_gradient_sync(sync_grads)
            with self.ctx, (nullcontext() if sync_grads or self.fsdp else model.no_sync()):
                _, loss = model(x, y, t_out=t_out)
                share = loss * (y != IGNORE).sum() / n_targets  # this slice's sum / global count
                (share * self.world).backward()
            loss_sum += share.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(),
                                              cfg.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": loss_sum, "lr": lr, "tokens": n_tokens, "flops": flops,
                "grad_norm": norm.full_tensor() if self.fsdp else norm, "t_out_share": out_share}

    def read(self, records, t_start, stop):
        """The CPU's one wait for the device per interval: log the steps, stop at a non-finite
        loss, time the interval (on the last record, returned); agree on a stop request."""
        asked = torch.tensor(float(stop.asked is not None), device=self.device)
        values = torch.stack([*(r["loss"] for r in records), asked])
        if self.ddp:  # each rank holds its targets' share of each loss, and its own stop flag
            dist.all_reduce(values)
        sync(self.device)  # the clock then measures the work done, not the work queued
        seconds, (*losses, stops) = time.perf_counter() - t_start, values.tolist()
        stop.signal = (stop.asked or "a stop request on another rank") if stops else None
        norms = torch.stack([r["grad_norm"] for r in records]).tolist()
        for record, loss, norm in zip(records, losses, norms):
            if not math.isfinite(loss):
                step = self.saved.get("ckpt_last.pt")
                last = (f"the last good checkpoint ({self.out_dir}/ckpt_last.pt, step {step}) is "
                        "untouched") if step is not None else "no checkpoint had been written yet"
                fail(f"the training loss is {loss} at step {record['step']} (read at step "
                     f"{self.step}). Stopping; {last}. Try a lower --lr, or --dtype float32.")
            record.update(loss=loss, grad_norm=norm)
        record.update(ms_per_step=1000 * seconds / len(records),
                      tok_per_s=sum(r.pop("tokens") for r in records) / seconds)
        if self.peak_flops:
            record["mfu"] = sum(r["flops"] for r in records) / seconds / self.peak_flops
        if self.device_type == "cuda":
            record["max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.log(*records)
        return record


def train(run, argv):
    """Claim out_dir, then the loop: evaluate every eval_interval steps, to max_iters or a stop."""
    cfg = run.cfg
    compiled = cfg.compile and compile_works(run.device)
    model = compile_blocks(run.raw_model) if compiled else run.raw_model
    if run.ddp and not run.fsdp:
        model = DDP(model, device_ids=[int(run.device[5:])] if run.device_type == "cuda" else None)
    if run.ddp:
        dist.barrier()  # every rank has checked out_dir (in Run) before rank 0 writes into it
    with StopRequest() as stop:  # from the first write on, Ctrl-C saves
        if run.master:
            run.log_file = open_log(run.out_dir, cfg.init_from == "resume", cfg.overwrite, run.step)
        if run.step == 0:  # every rank evaluates (under FSDP a forward needs them all)
            run.evaluate()
        bar = tqdm(total=cfg.max_iters, initial=run.step, disable=None if run.master else True,
                   unit="step", dynamic_ncols=True)  # disable=None: on a terminal only
        t_start, unread = time.perf_counter(), []
        while run.step < cfg.max_iters:
            unread.append(run.train_step(model))
            bar.update(1)
            if str(run.step) in cfg.keep_steps.split(","):
                run.checkpoint(keep=True)
            evaluating = run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters
            # The CPU waits for the GPU only at a read: every log_interval steps, before an eval (a
            # non-finite loss must stop the run before it saves) and on a stop request.
            if run.step % cfg.log_interval and not evaluating and not (stop.asked and not run.ddp):
                continue
            r, unread = run.read(unread, t_start, stop), []
            line = (f"loss {r['loss']:.4f}, {r['ms_per_step']:.1f} ms/step, "
                    f"{r['tok_per_s']:,.0f} tok/s"
                    + (f", t_out/T {r['t_out_share']:.2f}" if cfg.task == "sft" else "")
                    + (f", MFU {r['mfu']:.1%}" if "mfu" in r else ""))
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
        run.print(f"stopped by {stop.signal} after step {run.step}; saved {run.out_dir}/"
                  f"ckpt_last.pt. Resume with: {resume_command(argv)}")
        raise SystemExit(130)


def sft_report(run):
    """What the T_in/T_out split saved, and the exact-match accuracy on test.jsonl if any."""
    log = (run.out_dir / "log.jsonl").read_text().splitlines() if run.master else []
    if shares := [r["t_out_share"] for r in map(json.loads, log) if "t_out_share" in r]:
        covered = sum(shares) / len(shares)
        run.print(f"SFT: the output stream covered {covered:.1%} of the positions on average: the "
                  f"T_in/T_out split saved {1 - covered:.1%} of the output-token work against "
                  "t_out = T")
    if not (run.master or run.fsdp):  # under FSDP every rank takes part in each forward
        return

    def greedy(prompts, n_new):  # through the model's KV cache
        idx = torch.tensor(prompts, device=run.device)
        with run.ctx:
            out = run.raw_model.eval().generate(idx, n_new, temperature=0)
        return out[:, idx.size(1):].tolist()
    test = run.batches.examples.get("test", [])
    scores = exact_match_report(test, greedy, run.cfg.eval_exact_match, log=run.print)
    if scores and run.master:
        run.log({"step": run.step, "exact_match": scores})
        text = json.dumps(scores, indent=2) + "\n"
        atomic_write(run.out_dir / "exact_match.json", lambda f: f.write(text), mode="w")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config_name, cfg = parse_args(argv)
    run = Run(config_name, cfg)  # reads and checks everything; writes nothing
    try:
        if cfg.init_from == "resume" and run.step >= cfg.max_iters:  # write nothing, not even a log
            return run.print(f"nothing to do: {run.out_dir} is at step {run.step} of --max_iters "
                             f"{cfg.max_iters}; raise it to train on")
        what = f"config {config_name}" if config_name else "no --config: the defaults"
        if cfg.init_from not in ("scratch", "resume"):
            what += f", the model of {cfg.init_from}"  # its shape, listed
        run.print(f"{what}: " + ", ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
        run.print(f"model: {sum(p.numel() for p in run.raw_model.parameters()) / 1e6:.2f}M "
                  f"parameters, {run.raw_model.config}")
        start = f"; initialised from {cfg.init_from}" if cfg.init_from != "scratch" else ""
        run.print(f"device {run.device} ({run.precision}), world size {run.world}, data "
                  f"{run.data_dir} ({run.tokenizer_name} tokenizer){start}"
                  + (f" at step {run.step}" if run.step else ""))
        train(run, argv)
        if cfg.task == "sft":
            sft_report(run)
    finally:
        if run.log_file is not None:
            run.log_file.close()
        if run.ddp:
            dist.destroy_process_group()
    step = run.saved.get("ckpt_best.pt")
    when = "before this resume" if step is None else f"step {step}"
    best = f"best val loss {run.best_val:.4f} (ckpt_best.pt, {when})"
    if not math.isfinite(run.best_val):
        best = "no evaluation after training started, so no ckpt_best.pt"
    run.print(f"done: {run.step} steps; {best}; ckpt_last.pt at step {run.step}; in {run.out_dir}/")
    return run.best_val


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a second Ctrl-C in the loop
        sys.exit("\ninterrupted: stopped at once; checkpoints in out_dir are whole (atomic writes)")
