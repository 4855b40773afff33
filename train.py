"""
Train Orthros, or a baseline, on one GPU, on CPU, or on several GPUs with torchrun.

    python train.py --config tiny                      # under a minute on 2 CPU cores
    python train.py --config small                     # a few minutes on one GPU
    python train.py --config small --attn transformer  # the baselines: transformer | swa
    python train.py --config small --scale_offset false   # the paper's "w/o SO" ablation
    python train.py --config small --init_from resume  # continue from out_dir/ckpt_last.pt
    torchrun --standalone --nproc_per_node=2 train.py --config small   # DistributedDataParallel
    python train.py --config recall_tiny               # SFT on the recall task (2 CPU cores, minutes)
    python train.py --task sft --dataset path/to/folder --init_from out/small-orthros/ckpt_best.pt

Every field of TrainConfig below can be overridden with --key value (or --key=value); values
are type-checked and unknown keys are errors. `python train.py --help` lists them all.
Pre-training (--task pretrain) draws random windows of seq_len tokens from
data/<dataset>/train.bin and trains every position (t_out = T). SFT (--task sft) reads
train.jsonl / val.jsonl (format: data/sft.py) from data/<dataset>/ or from a folder path,
trains only the responses, and uses the smallest t_out that covers them; with a test.jsonl
it ends with the exact-match accuracy of greedy generation through the KV cache.
"""

import dataclasses
import json
import math
import os
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
from data.prepare_utils import DATA_ROOT, ensure_prepared, load_meta
from data.sft import collate, exact_match, load_examples, read_examples_dir
from data.tokenizer import get_tokenizer
from orthros import Orthros, OrthrosConfig


@dataclass
class TrainConfig:
    # data
    task: str = "pretrain"         # pretrain | sft
    dataset: str = "stdlib"        # data/<dataset>/ (prepared on demand), or a folder path (SFT)
    tokenizer: str = ""            # "" = the dataset's (meta.json), else byte | gpt2
    sft_overlong: str = "drop"     # SFT examples longer than seq_len: drop | truncate (the oldest tokens)
    curriculum: str = ""           # SFT: a split (e.g. train_short) used for the first curriculum_frac of steps
    curriculum_frac: float = 0.5
    eval_exact_match: int = -1     # SFT: test examples to generate at the end (-1 = all, 0 = none)
    # model (see OrthrosConfig)
    attn: str = "orthros"          # orthros | transformer | swa
    scale_offset: bool = True      # false = the paper's "Orthros w/o SO" ablation
    window: int = 128
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    conv_kernel: int = 0           # optional short convolution before K/V (not in the paper)
    swa_impl: str = "auto"         # auto (flex on CUDA, else blocked) | flex | blocked | dense
    seq_len: int = 1024            # T, tokens per training sequence
    max_seq_len: int = 0           # longest sequence the model accepts; 0 = seq_len
    # optimization: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    batch_size: int = 16           # sequences per micro-step (per GPU under torchrun)
    grad_accum: int = 1            # micro-steps per optimizer step
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0         # 0 = off
    # evaluation, logging, checkpoints
    eval_interval: int = 250       # evaluate and checkpoint every this many steps
    eval_iters: int = 20           # batches per split in each evaluation
    out_dir: str = ""              # default: out/<config>-<attn>
    init_from: str = "scratch"     # scratch | resume | path/to/ckpt.pt (e.g. a transformer to convert)
    seed: int = 1337
    device: str = "auto"           # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"            # auto (bf16 autocast where supported, else fp32) | float32 | bfloat16
    compile: bool = False          # torch.compile each block (model.compile_blocks())


# Named presets: each changes only what differs from the defaults above.
CONFIGS = {
    # Under a minute on 2 CPU cores: enough to watch the loss fall.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, window=32, seq_len=128, batch_size=16,
                 max_iters=150, lr=3e-3, warmup_iters=10, eval_interval=50, eval_iters=5),
    # A few minutes on one GPU; also runs, slower, on CPU. Head dim 64, window 128 as in the paper.
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


def parse_args(argv):
    """--config NAME plus --key value overrides -> (config name, TrainConfig)."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(f"configs: {', '.join(CONFIGS)}\nfields (defaults before any --config):")
        for f in fields(TrainConfig):
            print(f"  --{f.name} {f.default!r}")
        sys.exit(0)
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            sys.exit(f"error: expected --key value, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                sys.exit(f"error: {arg} needs a value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key, value))
    name = dict(pairs).pop("config", "small")
    if name not in CONFIGS:
        sys.exit(f"error: unknown config {name!r}; choose one of {list(CONFIGS)}")
    values = dict(CONFIGS[name])
    for key, value in pairs:
        if key == "config":
            continue
        if key not in types:
            close = [k for k in types if k.startswith(key[:3])]
            sys.exit(f"error: unknown option --{key}" + (f" (did you mean {', '.join('--' + k for k in close)}?)" if close else "")
                     + "; python train.py --help lists every option")
        values[key] = parse_value(key, value, types[key])
    cfg = TrainConfig(**values)
    if not cfg.out_dir:
        cfg.out_dir = f"out/{name}-{cfg.attn}" + ("-noso" if cfg.attn == "orthros" and not cfg.scale_offset else "")
    return name, cfg


def parse_value(key, value, typ):
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ)  # annotations may be strings
    if typ is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        sys.exit(f"error: --{key} takes true or false, got {value!r}")
    try:
        return typ(value)
    except ValueError:
        sys.exit(f"error: --{key} takes a {typ.__name__}, got {value!r}")


# -----------------------------------------------------------------------------
# Data: random windows of the token stream, the same on every rank until split by rank

class PretrainBatches:
    def __init__(self, data_dir, seq_len, device):
        self.paths = {split: Path(data_dir) / f"{split}.bin" for split in ("train", "val")}
        self.seq_len, self.device = seq_len, device
        for split, path in self.paths.items():
            n = len(np.memmap(path, dtype=np.uint16, mode="r"))
            if n <= seq_len + 1:
                sys.exit(f"error: {path} has {n} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                         "lower --seq_len or prepare more data")

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
        for needed in ("train", "val") + ((cfg.curriculum,) if cfg.curriculum else ()):
            if needed not in splits:
                sys.exit(f"error: {data_dir} has no {needed}.jsonl (SFT needs train.jsonl and val.jsonl)")
        self.examples = {}
        for name, path in splits.items():
            try:
                self.examples[name], report = load_examples(path, tokenizer, cfg.seq_len, cfg.sft_overlong)
            except ValueError as e:
                sys.exit(f"error: {e}")
            log(report)
        self.device = device

    def get(self, split, batch_size, generator):
        pool = self.examples[split]
        ix = torch.randint(len(pool), (batch_size,), generator=generator).tolist()
        x, y, t_out = collate([pool[i] for i in ix])
        return x.to(self.device), y.to(self.device), t_out


# -----------------------------------------------------------------------------
# Training

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


def pick_device(cfg):
    if cfg.device != "auto":
        return cfg.device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def autocast_context(cfg, device_type):
    """bf16 autocast where the device supports it (auto), else plain fp32."""
    want_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device_type == "cuda"
                                             and torch.cuda.is_bf16_supported())
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        sys.exit(f"error: --dtype must be auto, float32 or bfloat16, got {cfg.dtype!r}")
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
def estimate_loss(model, batches, cfg, ctx, seed):
    """Mean loss over eval_iters batches per split; the same batches every time (fixed seed)."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(cfg.eval_iters):
            x, y, t_out = batches.get(split, cfg.batch_size, gen)
            with ctx:
                _, loss = model(x, y, t_out=t_out)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def main(argv=None):
    config_name, cfg = parse_args(sys.argv[1:] if argv is None else argv)

    # torchrun sets RANK/WORLD_SIZE; otherwise this is a single process.
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(cfg)
    if ddp:
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    master = rank == 0
    device_type = "cuda" if device.startswith("cuda") else device.split(":")[0]
    torch.manual_seed(cfg.seed)
    ctx, precision = autocast_context(cfg, device_type)

    if cfg.task not in ("pretrain", "sft"):
        sys.exit(f"error: --task must be pretrain or sft, got {cfg.task!r}")
    if Path(cfg.dataset).is_dir():  # a folder of the user's own (SFT JSONL)
        data_dir = Path(cfg.dataset)
    else:
        try:
            data_dir = ensure_prepared(cfg.dataset) if master else DATA_ROOT / cfg.dataset
        except (ValueError, OSError, RuntimeError) as e:  # unknown name, no file, no network
            sys.exit(f"error: preparing dataset {cfg.dataset!r} failed: {e}")
    if ddp:
        dist.barrier()  # rank 0 prepares the data once; the others wait for it
    meta = load_meta(data_dir) if (data_dir / "meta.json").exists() else {}

    # ---- the model: from scratch, resumed, or initialised from another checkpoint
    out_dir = Path(cfg.out_dir)
    ckpt, start_step, best_val = None, 0, float("inf")
    try:
        if cfg.init_from == "resume":
            ckpt = load_checkpoint(out_dir / "ckpt_last.pt")
        elif cfg.init_from != "scratch":
            ckpt = load_checkpoint(cfg.init_from)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: --init_from {cfg.init_from}: {e}")
    # The tokenizer: asked for, else the dataset's, else the checkpoint's, else bytes. They must agree.
    tokenizer_name = cfg.tokenizer or meta.get("tokenizer") or (ckpt or {}).get("tokenizer") or "byte"
    for source, name in (("the dataset", meta.get("tokenizer")), ("the checkpoint", (ckpt or {}).get("tokenizer"))):
        if name and name != tokenizer_name:
            sys.exit(f"error: {source} uses the {name!r} tokenizer but this run uses {tokenizer_name!r}; "
                     "a model only understands the tokenizer it was trained with")
    tokenizer = get_tokenizer(tokenizer_name)
    if cfg.task == "pretrain":
        batches = PretrainBatches(data_dir, cfg.seq_len, device)
    else:
        batches = SFTBatches(data_dir, cfg, tokenizer, device, log=print if master else lambda *a: None)
    model_args = dict(vocab_size=tokenizer.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                      window=cfg.window, attn=cfg.attn, scale_offset=cfg.scale_offset, dropout=cfg.dropout,
                      conv_kernel=cfg.conv_kernel, swa_impl=cfg.swa_impl, max_seq_len=cfg.max_seq_len or cfg.seq_len)
    if cfg.init_from == "resume":
        model_args = ckpt["model_config"]  # resume the very same model
    elif ckpt is not None:
        # Shapes come from the checkpoint; attn, window, scale_offset from this run. Loading a
        # transformer into attn=orthros is the paper's conversion (scale-offsets start at identity).
        model_args.update({k: ckpt["model_config"][k] for k in SHAPE_FIELDS})
    try:
        model = Orthros(OrthrosConfig(**model_args)).to(device)
    except ValueError as e:  # e.g. an unknown --attn, or heads that do not divide n_embd
        sys.exit(f"error: {e}")
    optimizer = make_optimizer(model, cfg, device_type)
    train_gen = torch.Generator().manual_seed(cfg.seed)  # draws the training batches
    if cfg.init_from == "resume":
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step, best_val = ckpt["step"], ckpt["best_val_loss"]
        set_rng_state(ckpt["rng"], train_gen, device_type)
    elif ckpt is not None:
        try:
            model.load_transformer_weights(ckpt["model"])
        except ValueError as e:
            sys.exit(f"error: --init_from {cfg.init_from}: {e}")
    if master:
        print(f"config {config_name}: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config}")
        print(f"device {device} ({precision}), world size {world}, data {data_dir} ({tokenizer_name} tokenizer)")
        if ckpt is not None:
            print(f"initialised from {cfg.init_from}" + (f" at step {start_step}" if start_step else ""))

    raw_model = model
    if cfg.compile and compile_works(device):
        model.compile_blocks()
    if ddp:
        model = DDP(model, device_ids=[int(device.split(":")[1])] if device_type == "cuda" else None)

    def checkpoint(step, path):
        save_checkpoint(path, model=raw_model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                        best_val_loss=best_val, model_config=dataclasses.asdict(raw_model.config),
                        train_config=dataclasses.asdict(cfg), config_name=config_name,
                        tokenizer=tokenizer_name, dataset=cfg.dataset, rng=rng_state(train_gen, device_type))

    log_file = None
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(out_dir / "log.jsonl", "a" if cfg.init_from == "resume" else "w")

    def log(record):
        if master:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

    def evaluate(step):
        nonlocal best_val
        losses = estimate_loss(raw_model, batches, cfg, ctx, seed=cfg.seed + 1)
        log({"step": step, "train_loss": losses["train"], "val_loss": losses["val"]})
        tqdm.write(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if step > start_step:  # not for the evaluation before training
            if losses["val"] < best_val:
                best_val = losses["val"]
                checkpoint(step, out_dir / "ckpt_best.pt")
            checkpoint(step, out_dir / "ckpt_last.pt")

    if master and start_step == 0:
        evaluate(0)
    pbar = tqdm(total=cfg.max_iters, initial=start_step, disable=not master, unit="step", dynamic_ncols=True)
    t_last = time.time()
    for step in range(start_step, cfg.max_iters):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        split = cfg.curriculum if cfg.curriculum and step < cfg.curriculum_frac * cfg.max_iters else "train"
        loss_sum = torch.zeros((), device=device)
        n_tokens, out_share = 0, 0.0
        for micro in range(cfg.grad_accum):
            # Every rank draws the same global batch and keeps its own slice, so the result does
            # not depend on how many processes share the work.
            x, y, t_out = batches.get(split, cfg.batch_size * world, train_gen)
            x, y = x[rank * cfg.batch_size:(rank + 1) * cfg.batch_size], y[rank * cfg.batch_size:(rank + 1) * cfg.batch_size]
            n_tokens += x.numel() * world
            out_share += t_out / x.size(1) / cfg.grad_accum  # 1.0 in pre-training; SFT runs T + t_out, not 2T
            sync = not ddp or micro == cfg.grad_accum - 1
            with ctx, (nullcontext() if sync else model.no_sync()):
                _, loss = model(x, y, t_out=t_out)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach() / cfg.grad_accum
        if ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        train_loss = loss_sum.item()
        if not math.isfinite(train_loss):
            if master:
                pbar.close()
                print(f"\nerror: the training loss is {train_loss} at step {step + 1}. Stopping; the last good "
                      f"checkpoint in {out_dir} is untouched. Try a lower --lr, or --dtype float32.")
            if ddp:
                dist.destroy_process_group()
            raise SystemExit(1)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or float("inf")).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        now = time.time()
        tok_per_s = n_tokens / (now - t_last)
        t_last = now
        log({"step": step + 1, "loss": train_loss, "lr": lr, "grad_norm": grad_norm, "tok_per_s": tok_per_s,
             "t_out_share": out_share})
        pbar.update(1)
        postfix = dict(loss=f"{train_loss:.4f}", tok_s=f"{tok_per_s:,.0f}")
        if cfg.task == "sft":
            postfix["t_out/T"] = f"{out_share:.2f}"
        pbar.set_postfix(**postfix)
        if master and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.max_iters):
            evaluate(step + 1)
    pbar.close()
    if master:
        if cfg.task == "sft":
            shares = [json.loads(line).get("t_out_share") for line in open(out_dir / "log.jsonl")]
            shares = [s for s in shares if s is not None]
            if shares:
                mean = sum(shares) / len(shares)
                print(f"SFT: the output stream covered {mean:.1%} of the positions on average: the T_in/T_out "
                      f"split saved {1 - mean:.1%} of the output-token work against t_out = T")
        if cfg.task == "sft" and cfg.eval_exact_match and "test" in batches.examples:
            examples = batches.examples["test"]
            examples = examples if cfg.eval_exact_match < 0 else examples[:cfg.eval_exact_match]
            scores = exact_match(examples, generate_greedy(raw_model, device, ctx))
            log({"step": cfg.max_iters, "exact_match": scores})
            (out_dir / "exact_match.json").write_text(json.dumps(scores, indent=2) + "\n")
            print("exact-match accuracy of greedy generation (KV cache) on test.jsonl, by distance bucket:")
            for bucket, r in scores.items():
                print(f"  {bucket:>12}: {r['accuracy']:.3f}  ({r['n']} examples)")
        log_file.close()
        print(f"done: best val loss {best_val:.4f}; checkpoints in {out_dir}/")
    if ddp:
        dist.destroy_process_group()
    return best_val


if __name__ == "__main__":
    main()
