"""
Train Orthros, or a baseline, on one GPU, on CPU, or on several GPUs with torchrun.

    python train.py --config tiny                      # 2 CPU cores: 150 steps in about 10 s
    python train.py --config small                     # one GPU: about 2 minutes on an H200
    python train.py --config small --attn transformer  # the baselines: transformer | swa
    python train.py --config small --scale_offset false   # the paper's "w/o SO" ablation
    python train.py --config small --init_from resume  # continue the run in out_dir from ckpt_last.pt
    python train.py --config tiny --task sft --dataset data/sft_example --init_from out/tiny-orthros/ckpt_best.pt
    torchrun --standalone --nproc_per_node=2 train.py --config small   # DistributedDataParallel

Every field of TrainConfig is an option (--help lists them). Pre-training trains every position
(t_out = T); SFT trains only the responses, with the smallest t_out that covers them (data/sft.py).
A run never writes over another run's files, and Ctrl-C stops after the step and saves ckpt_last.pt.
"""

import os
import signal
import sys


def interrupted_at_start(*_):
    """Ctrl-C before training starts (torch still loading, the run being set up): one line, then exit at
    once. Nothing is written before training, so nothing is lost. NOTE: os._exit, not sys.exit: a
    SystemExit raised inside `import torch` can be swallowed there, and the run would go on."""
    sys.stderr.write("\ninterrupted before training started; nothing was written\n")
    os._exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted_at_start)

import argparse
import dataclasses
import inspect
import json
import math
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import ArgumentParser, load_checkpoint, pick_device, save_checkpoint
from data.prepare_utils import PretrainBatches, atomic_write, find_dataset, load_meta
from data.sft import SFTBatches, exact_match_report
from data.tokenizer import get_tokenizer
from orthros import ATTN_TYPES, Orthros, OrthrosConfig, compile_blocks


@dataclass
class TrainConfig:
    # data
    task: str = "pretrain"         # pretrain (every position predicts) | sft (prompt/response JSONL)
    dataset: str = "stdlib"        # a name in data/ (prepared on first use), or a folder path (SFT JSONL)
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
    compile: bool = False          # torch.compile each block (orthros.compile_blocks)


CONFIGS = {  # named presets: each sets only what differs from the defaults above
    # About 10 s on 2 CPU cores: enough to watch the loss fall.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, window=32, seq_len=128, batch_size=16,
                 max_iters=150, lr=3e-3, warmup_iters=10, eval_interval=50, eval_iters=5),
    # A GPU command: about 2 minutes on one H200 (hours on a CPU). Head dim 64, window 128 as in the paper.
    "small": dict(),
    # The recall task (data/recall), SFT from scratch, window 128: 1-2 minutes on one H200.
    "recall": dict(task="sft", dataset="recall", n_layer=2, n_head=4, n_embd=64, window=128, conv_kernel=3,
                   seq_len=2200, batch_size=32, max_iters=3600, lr=3e-3, warmup_iters=50, eval_interval=400,
                   eval_iters=5, curriculum="train_short", curriculum_frac=0.75, weight_decay=0.0),
    # The same at window 32 (data/recall_tiny): 3-4 minutes on 2 idle CPU cores.
    "recall_tiny": dict(task="sft", dataset="recall_tiny", n_layer=2, n_head=4, n_embd=64, window=32, curriculum_frac=0.75,
                        conv_kernel=3, seq_len=384, batch_size=32, max_iters=2400, lr=3e-3, warmup_iters=50,
                        eval_interval=200, eval_iters=5, curriculum="train_short", weight_decay=0.0),
}
SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "conv_kernel")  # a checkpoint's values win
RUN_FILES = ("log.jsonl", "ckpt_last.pt", "ckpt_best.pt", "exact_match.json")  # what a run writes in out_dir


def fail(message):
    """Stop with one line on stderr: what is wrong and what to do."""
    raise SystemExit(f"error: {message}")


# -----------------------------------------------------------------------------
# The command line, generated from TrainConfig: each field's comment is its help

def field_help():
    """{field name: the comment after it in TrainConfig's source}."""
    return dict(re.findall(r"^\s+(\w+): \w+ = .*?#\s*(.*)$", inspect.getsource(TrainConfig), re.M))


def value_parser(typ):
    """The argparse type of a field, with errors that read 'takes an integer, got ...'."""
    def parse(value):
        try:
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()] if typ is bool else typ(value)
        except (KeyError, ValueError):
            words = {bool: "true or false", int: "an integer", float: "a float"}.get(typ, "a string")
            raise argparse.ArgumentTypeError(f"takes {words}, got {value!r}") from None
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
        parser.add_argument(f"--{f.name}", type=value_parser(f.type), default=argparse.SUPPRESS, metavar=f.type.__name__.upper(),
                            help=f"{helps.get(f.name, '')} (default: {f.default!r})".replace("%", "%%"))
    return parser


def parse_args(argv):
    """--config NAME plus --key value overrides -> (config name, TrainConfig)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        key = unknown[0].split("=")[0]
        fail((f"unknown option {key}" if key.startswith("--") else f"expected --key value, got {unknown[0]!r}")
             + "; python train.py --help lists every option")
    values = vars(args)
    name = values.pop("config")
    cfg = TrainConfig(**{**CONFIGS[name], **values})
    if not cfg.out_dir:  # out/<config>-<attn>[-noso]; SFT on a pre-training config adds -sft-<dataset>
        cfg.out_dir = f"out/{name}-{cfg.attn}" + ("-noso" if cfg.attn == "orthros" and not cfg.scale_offset else "")
        if cfg.task != CONFIGS[name].get("task", "pretrain"):
            cfg.out_dir += f"-{cfg.task}-{Path(cfg.dataset).name or 'data'}"
    return name, cfg


def check_config(cfg):
    """Every option's range, before anything is read or written."""
    choices = {"task": ("pretrain", "sft"), "attn": ATTN_TYPES, "sft_overlong": ("drop", "truncate"), "dtype": ("auto", "float32", "bfloat16")}
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            fail(f"--{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")
    at_least = dict(batch_size=1, grad_accum=1, eval_interval=1, eval_iters=1, seq_len=1, window=1, n_layer=1, n_head=1,
                    n_embd=1, max_iters=0, warmup_iters=0, max_seq_len=0, conv_kernel=0, lr=0, weight_decay=0, grad_clip=0)
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            fail(f"--{key} must be >= {low}, got {getattr(cfg, key)}")
    for key, top in {"min_lr_ratio": "]", "curriculum_frac": "]", "beta1": ")", "beta2": ")", "dropout": ")"}.items():
        value = getattr(cfg, key)
        if not 0 <= value <= 1 or (top == ")" and value == 1):
            fail(f"--{key} must be in [0, 1{top}, got {value}")
    if cfg.max_seq_len and cfg.max_seq_len < cfg.seq_len:
        fail(f"--max_seq_len ({cfg.max_seq_len}) must be 0 or >= --seq_len ({cfg.seq_len})")


# -----------------------------------------------------------------------------
# The model, the optimizer, the schedule, evaluation

def build_model(config_name, cfg, ckpt, vocab_size, device):
    """The model from scratch, resumed, or initialised from another checkpoint's weights."""
    model_args = dict(vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                      window=cfg.window, attn=cfg.attn, scale_offset=cfg.scale_offset, dropout=cfg.dropout,
                      conv_kernel=cfg.conv_kernel, max_seq_len=cfg.max_seq_len or cfg.seq_len)
    if ckpt is not None:  # shapes come from the checkpoint; on resume everything does
        preset, shapes = TrainConfig(**CONFIGS[config_name]), ckpt["model_config"]
        ignored = [f"--{k} {getattr(cfg, k)}" for k in SHAPE_FIELDS[1:] if getattr(preset, k) != getattr(cfg, k) != shapes[k]]
        if ignored:
            print(f"note: {', '.join(ignored)} ignored: the checkpoint's shape wins ("
                  + ", ".join(f"{k}={shapes[k]}" for k in SHAPE_FIELDS[1:]) + ")")
        if cfg.init_from == "resume":
            model_args = dict(shapes)
        else:  # attn, window, scale_offset from this run: transformer -> orthros is the paper's conversion
            model_args.update({k: shapes[k] for k in SHAPE_FIELDS})
            model_args["max_seq_len"] = max(model_args["max_seq_len"], cfg.seq_len)
    try:
        model = Orthros(OrthrosConfig(**model_args)).to(device)
        if ckpt is not None and cfg.init_from == "resume":
            model.load_state_dict(ckpt["model"])
        elif ckpt is not None:
            model.load_transformer_weights(ckpt["model"])
    except ValueError as e:  # heads that do not divide n_embd; weights of another model
        fail(f"--init_from {cfg.init_from}: {e}" if ckpt is not None else str(e))
    return model


def lr_at(step, cfg):
    """Linear warmup, then cosine decay from lr to min_lr_ratio * lr at max_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def compile_works(device):
    """Whether torch.compile works here (it needs Triton on GPUs, a C++ compiler on CPU): a note, not a traceback."""
    try:
        torch.compile(lambda x: x + 1)(torch.ones(1, device=device))
        return True
    except Exception as e:
        print(f"note: torch.compile does not work here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "training without it")
        return False


# -----------------------------------------------------------------------------
# The run's folder and its checkpoints: never write over another run's files; Ctrl-C saves

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


def claim_out_dir(cfg):
    """Before anything is written: out_dir holds no other run (unless resumed or --overwrite) nor our start."""
    out_dir = Path(cfg.out_dir)
    if cfg.init_from not in ("scratch", "resume") and out_dir.resolve() in Path(cfg.init_from).resolve().parents:
        fail(f"--init_from {cfg.init_from} lies in --out_dir {out_dir}: this run would write over the run it "
             "starts from. Give it its own --out_dir")
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if present and cfg.init_from != "resume" and not cfg.overwrite:
        fail(f"{out_dir} already holds a run ({', '.join(present)}). Continue it with --init_from resume, "
             "start a new one with --out_dir NEW_DIR, or replace it with --overwrite true")


def open_log(cfg, start_step):
    """out_dir/log.jsonl for appending. A resumed run first drops the records after its checkpoint's
    step (they are about to be redone); --overwrite first deletes the previous run's files."""
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
    """SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current step and save ckpt_last.pt.
    A second Ctrl-C stops at once (KeyboardInterrupt), without saving; a repeated SIGTERM just waits."""

    def __enter__(self):
        self.signal = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            tqdm.write(f"{self.signal}: stopping after this step and saving ckpt_last.pt "
                       "(Ctrl-C again stops at once, without saving)")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt


def resume_command(argv):
    """The command line that continues this run: the same options, with --init_from resume."""
    kept = re.sub(r"\s*--(init_from|overwrite)(=|\s+)\S+", "", " " + " ".join(argv)).strip()
    return f"python train.py {kept} --init_from resume".replace("  ", " ")


# -----------------------------------------------------------------------------
# The run: Run reads and checks everything (writing nothing), then train() is the loop

class Run:
    """A run's state: device and DDP rank, data, model, optimizer, step, and its out_dir."""

    def __init__(self, config_name, cfg):
        self.config_name, self.cfg, self.out_dir = config_name, cfg, Path(cfg.out_dir)
        self.ddp = int(os.environ.get("RANK", -1)) != -1  # set by torchrun
        self.rank, self.world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        self.master = self.rank == 0  # rank 0 evaluates, logs and saves
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
            self.init_ckpt = ckpt = load_init_checkpoint(cfg)
            # The tokenizer: the dataset's, else the checkpoint's, else bytes. They must agree.
            self.tokenizer_name = meta.get("tokenizer") or (ckpt or {}).get("tokenizer") or "byte"
            if ckpt is not None and ckpt["tokenizer"] != self.tokenizer_name:
                fail(f"the checkpoint uses the {ckpt['tokenizer']!r} tokenizer but the dataset {self.tokenizer_name!r}; "
                     "a model only understands the tokenizer it was trained with")
            tokenizer = get_tokenizer(self.tokenizer_name)
            self.batches = (PretrainBatches(self.data_dir, cfg.seq_len, self.device) if cfg.task == "pretrain" else
                            SFTBatches(self.data_dir, tokenizer, cfg.seq_len, cfg.sft_overlong, cfg.curriculum,
                                       self.device, log=self.print))
        except (ValueError, RuntimeError, FileNotFoundError, UnicodeDecodeError) as e:
            fail(str(e).splitlines()[0])
        self.device_type = torch.device(self.device).type
        bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device_type == "cuda" and torch.cuda.is_bf16_supported())
        self.ctx = torch.autocast(self.device_type, dtype=torch.bfloat16) if bf16 else nullcontext()
        self.precision = "bfloat16 autocast" if bf16 else "float32"
        torch.manual_seed(cfg.seed)
        self.raw_model = build_model(config_name, cfg, ckpt, tokenizer.vocab_size, self.device)
        decay = [p for p in self.raw_model.parameters() if p.dim() == 2]  # matrices; not norms, scale-offsets, conv
        rest = [p for p in self.raw_model.parameters() if p.dim() != 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                                           lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=self.device_type == "cuda")
        self.train_gen = torch.Generator().manual_seed(cfg.seed)  # draws the training batches
        self.step, self.best_val = 0, float("inf")
        if ckpt is not None and cfg.init_from == "resume":
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.step, self.best_val = ckpt["step"], ckpt["best_val_loss"]
            self.train_gen.set_state(ckpt["rng"]["data"])
            torch.set_rng_state(ckpt["rng"]["torch"])
            if "cuda" in ckpt["rng"] and self.device_type == "cuda":
                torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        self.start_step, self.saved, self.log_file = self.step, {}, None  # saved: checkpoint name -> step

    def print(self, *args):
        if self.master:
            print(*args)

    def log(self, record):
        if self.master:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def checkpoint(self, name):
        """Save everything a resume needs: model, optimizer, step, configs and the random states."""
        rng = {"data": self.train_gen.get_state(), "torch": torch.get_rng_state(),
               **({"cuda": torch.cuda.get_rng_state()} if self.device_type == "cuda" else {})}
        save_checkpoint(self.out_dir / name, model=self.raw_model.state_dict(), optimizer=self.optimizer.state_dict(),
                        step=self.step, best_val_loss=self.best_val, model_config=dataclasses.asdict(self.raw_model.config),
                        train_config=dataclasses.asdict(self.cfg), config_name=self.config_name,
                        tokenizer=self.tokenizer_name, dataset=self.cfg.dataset, rng=rng)
        self.saved[name] = self.step

    @torch.no_grad()
    def evaluate(self):
        """The mean loss over eval_iters batches per split, the same batches every time (a fixed seed);
        once training has started, save ckpt_last.pt (and ckpt_best.pt when val improved)."""
        cfg, model, losses = self.cfg, self.raw_model.eval(), {}
        bar = tqdm(total=2 * cfg.eval_iters, desc=f"eval at step {self.step}", unit="batch", leave=False)
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
        tqdm.write(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if self.step > self.start_step:
            if losses["val"] < self.best_val:
                self.best_val = losses["val"]
                self.checkpoint("ckpt_best.pt")
            self.checkpoint("ckpt_last.pt")

    def train_step(self, model):
        """One optimizer step (grad_accum micro-steps). Returns its log record."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        split = cfg.curriculum if cfg.curriculum and self.step < cfg.curriculum_frac * cfg.max_iters else "train"
        loss_sum, n_tokens, out_share = torch.zeros((), device=self.device), 0, 0.0
        for micro in range(cfg.grad_accum):
            # Every rank draws the same global batch and keeps its own slice: the result does not
            # depend on how many processes share the work.
            x, y, t_out = self.batches.get(split, cfg.batch_size * self.world, self.train_gen)
            mine = slice(self.rank * cfg.batch_size, (self.rank + 1) * cfg.batch_size)
            x, y = x[mine], y[mine]
            n_tokens += x.numel() * self.world
            out_share += t_out / x.size(1) / cfg.grad_accum  # 1.0 in pre-training; SFT runs T + t_out, not 2T
            sync_grads = not self.ddp or micro == cfg.grad_accum - 1
            with self.ctx, (nullcontext() if sync_grads else model.no_sync()):
                _, loss = model(x, y, t_out=t_out)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach() / cfg.grad_accum
        if self.ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if not math.isfinite(loss_sum.item()):
            raise FloatingPointError(f"the training loss is {loss_sum.item()} at step {self.step + 1}")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip or float("inf")).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": loss_sum.item(), "lr": lr, "grad_norm": grad_norm, "tokens": n_tokens,
                "t_out_share": out_share}

    def stop_requested(self, stop):
        """Whether a stop was asked for, on any rank (they must all stop at the same step)."""
        if not self.ddp:
            return stop.signal is not None
        flag = torch.tensor(float(stop.signal is not None), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop.signal = stop.signal or ("a stop request on another rank" if flag.item() else None)
        return bool(flag.item())


def train(run, argv):
    """Claim out_dir, then the loop: evaluate every eval_interval steps; stop at max_iters or when asked."""
    cfg = run.cfg
    claim_out_dir(cfg)
    if run.ddp:
        dist.barrier()  # every rank has checked out_dir before rank 0 writes into it
    run.print(f"config {run.config_name}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
    run.print(f"model: {sum(p.numel() for p in run.raw_model.parameters()) / 1e6:.2f}M parameters, {run.raw_model.config}")
    run.print(f"device {run.device} ({run.precision}), world size {run.world}, data {run.data_dir} "
              f"({run.tokenizer_name} tokenizer)" + (f"; initialised from {cfg.init_from}" if run.init_ckpt else "")
              + (f" at step {run.step}" if run.step else ""))
    model = compile_blocks(run.raw_model) if cfg.compile and compile_works(run.device) else run.raw_model
    if run.ddp:
        model = DDP(model, device_ids=[int(run.device.split(":")[1])] if run.device_type == "cuda" else None)
    if run.master:
        run.log_file = open_log(cfg, run.step)
    with StopRequest() as stop:
        if run.master and run.step == 0:
            run.evaluate()
        bar = tqdm(total=cfg.max_iters, initial=run.step, disable=not run.master, unit="step", dynamic_ncols=True)
        t_last = time.time()
        while run.step < cfg.max_iters and not run.stop_requested(stop):
            record = run.train_step(model)
            record["tok_per_s"], t_last = record.pop("tokens") / (time.time() - t_last), time.time()
            run.log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tok_per_s']:,.0f}",
                            **({"t_out/T": f"{record['t_out_share']:.2f}"} if cfg.task == "sft" else {}))
            if run.master and (run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters):
                run.evaluate()
        bar.close()
        if run.master and run.saved.get("ckpt_last.pt") != run.step:
            run.checkpoint("ckpt_last.pt")  # after a stop request, and for --max_iters 0
    if stop.signal is not None:
        run.print(f"stopped by {stop.signal} after step {run.step}; saved {run.out_dir}/ckpt_last.pt. "
                  f"Resume with: {resume_command(argv)}")
        raise SystemExit(130)


def sft_report(run):
    """What the T_in/T_out split saved, and the exact-match accuracy on test.jsonl if there is one."""
    shares = [r["t_out_share"] for r in map(json.loads, open(run.out_dir / "log.jsonl")) if "t_out_share" in r]
    if shares:
        mean = sum(shares) / len(shares)
        print(f"SFT: the output stream covered {mean:.1%} of the positions on average: the T_in/T_out "
              f"split saved {1 - mean:.1%} of the output-token work against t_out = T")

    def greedy(prompts, n_new):  # through the model's KV cache
        idx = torch.tensor(prompts, device=run.device)
        with run.ctx:
            return run.raw_model.eval().generate(idx, n_new, temperature=0)[:, idx.size(1):].tolist()

    scores = exact_match_report(run.batches.examples.get("test", []), greedy, run.cfg.eval_exact_match)
    if scores:
        run.log({"step": run.step, "exact_match": scores})
        atomic_write(run.out_dir / "exact_match.json", lambda f: f.write(json.dumps(scores, indent=2) + "\n"), mode="w")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config_name, cfg = parse_args(argv)
    check_config(cfg)
    run = Run(config_name, cfg)  # reads and checks everything; writes nothing
    if signal.getsignal(signal.SIGINT) is interrupted_at_start:   # from here on Ctrl-C is the loop's (StopRequest)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        train(run, argv)
        if run.master and cfg.task == "sft":
            sft_report(run)
    except FloatingPointError as e:
        if run.master:
            last = (f"the last good checkpoint ({run.out_dir}/ckpt_last.pt, step {run.saved['ckpt_last.pt']}) is untouched"
                    if "ckpt_last.pt" in run.saved else "no checkpoint had been written yet")
            print(f"\nerror: {e}. Stopping; {last}. Try a lower --lr, or --dtype float32.", file=sys.stderr)
        raise SystemExit(1)
    finally:
        if run.log_file is not None:
            run.log_file.close()
        if run.ddp:
            dist.destroy_process_group()
    if run.master:
        best = (f"best val loss {run.best_val:.4f} (ckpt_best.pt, step {run.saved['ckpt_best.pt']})"
                if "ckpt_best.pt" in run.saved else "no evaluation after training started, so no ckpt_best.pt")
        print(f"done: {run.step} steps; {best}; ckpt_last.pt at step {run.step}; in {run.out_dir}/")
    return run.best_val


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a second Ctrl-C
        sys.exit("\ninterrupted: stopped at once; checkpoints already in out_dir are whole (they are written atomically)")
