"""
SmolLM2-135M-Instruct (convert/from_gguf.py) converted into Orthros, before and after continued
pre-training (CPT), as in the paper's section 4.3 and Table 2.

    python repro/smollm2.py eval      # CPU: the original, Orthros and SWA (no output stream)
    python repro/smollm2.py cpt       # one GPU: CPT curves of Orthros, Base CPT and SWA, then at 8K
    python repro/smollm2.py prefill   # one GPU: the converted model's prefill and the original's

eval: the loss on 2048 tokens of held-out stdlib files (positions < w and >= w apart) and a
passkey (5 digits in 300 to 2,000 tokens of filler). cpt trains each of --attns on --data, measured
as eval is at --curve's shares of --steps, then --long_steps at --long_seq_len; run again, it skips
what is done and resumes a stopped run.
"""

import argparse
import itertools
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: import from the repository root
from checkpoint import load_checkpoint, model_from_checkpoint, pick_device, run_meta
from convert.from_gguf import SMOLLM2_DIR
from data.prepare_utils import atomic_write, load_meta, write_json_atomic
from data.stdlib.prepare import find_files, is_val
from data.tokenizer import get_tokenizer

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
         "memorize it.\n")
NEEDLE = " The pass key is {0}. Remember it. {0} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
LENGTHS, DEPTHS, KEYS_PER_CELL = (300, 600, 1200, 2000), (0.1, 0.3, 0.5, 0.7, 0.9), 2
LONG = 8192  # SmolLM2's positions: what the models accept (RoPE is computed on the fly)
ATTNS = ("orthros", "transformer", "swa")


def held_out_documents(tokenizer, n_docs, seq_len):
    """(path, first seq_len tokens) of the first n_docs stdlib val files that hold as many."""
    src, docs = Path(sysconfig.get_paths()["stdlib"]), []
    for rel in (p for p in find_files(src) if is_val(p, 0.1)):
        ids = tokenizer.encode((src / rel).read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= seq_len:
            docs.append((rel.as_posix(), ids[:seq_len]))
        if len(docs) == n_docs:
            break
    return docs


def val_documents(data_dir, n_docs, seq_len):
    """(n_docs, seq_len): the first tokens of the first val.bin documents that hold as many."""
    meta = load_meta(data_dir)
    ids = np.fromfile(Path(data_dir) / "val.bin", dtype=meta["dtype"])
    ends = np.flatnonzero(ids == meta["eot"])  # each document ends with the end token
    docs = [ids[a:a + seq_len] for a, b in zip(np.r_[0, ends[:-1] + 1], ends) if b - a >= seq_len]
    if len(docs) < n_docs:
        raise ValueError(f"{data_dir}/val.bin has {len(docs)} documents of >= {seq_len} tokens; "
                         "lower --docs or raise its val_fraction")
    return torch.from_numpy(np.stack(docs[:n_docs]).astype(np.int64))


def passkey_prompts(tokenizer, keys_per_cell=KEYS_PER_CELL, seed=0, lengths=LENGTHS):
    """(length, depth, key, distance from the key to the end, ids), keys_per_cell a cell."""
    rng, prompts = random.Random(seed), []
    filler, intro, question = map(tokenizer.encode, (FILLER, INTRO, QUESTION))
    for length, depth, _ in itertools.product(lengths, DEPTHS, range(keys_per_cell)):
        key = str(rng.randint(10000, 99999))
        needle = tokenizer.encode(NEEDLE.format(key))
        n_fill = length - len(intro) - len(needle) - len(question)
        fill = (filler * (n_fill // len(filler) + 1))[:n_fill]
        before = fill[:int(depth * n_fill)]
        ids = intro + before + needle + fill[len(before):] + question
        prompts.append((length, depth, key, len(ids) - len(intro) - len(before), ids))
    return prompts


class Model:
    """One model to evaluate: logits(idx) over every position, and greedy(idx, n) new tokens."""

    def __init__(self, label, source, attn=None, window=128, device="cpu"):
        self.label, self.hf = label, None
        if attn == "hf":  # the original implementation: transformers' model of the folder
            from transformers import AutoModelForCausalLM
            self.hf = AutoModelForCausalLM.from_pretrained(
                source.removeprefix("hf:"), dtype=torch.float32).to(device).eval()
            return
        ckpt = load_checkpoint(source)
        overrides = {"attn": attn} if attn else {}
        if (attn or ckpt["model_config"]["attn"]) != "transformer":
            overrides["window"] = window
        model = model_from_checkpoint(ckpt, max_seq_len=LONG, **overrides)
        self.model = model.float().to(device).eval()

    @torch.no_grad()
    def logits(self, idx):
        return self.hf(idx).logits if self.hf is not None else self.model(idx)[0]

    @torch.no_grad()
    def greedy(self, idx, n):
        """(B, L) prompts of one length -> their n greedy tokens each, (B, n) as lists."""
        if self.hf is not None:
            out = self.hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        else:
            out = self.model.generate(idx, n, temperature=0)
        return out[:, idx.size(1):].tolist()


def measure(model, docs, prompts, tokenizer, window, device):
    """One Model's {"loss", "loss_below_w", "loss_from_w", "passkey": [per trial]}."""
    t0, losses, trials = time.time(), [], []
    for idx in docs.to(device).split(max(1, LONG // docs.size(1))):
        logits = model.logits(idx)[:, :-1].float().transpose(1, 2)  # (B, vocab, T - 1)
        losses.append(F.cross_entropy(logits, idx[:, 1:], reduction="none").cpu())  # t: t + 1
    loss = torch.cat(losses)  # (docs, T - 1)
    lengths = sorted({p[0] for p in prompts})
    for n in lengths:
        group = [p for p in prompts if p[0] == n]  # of n tokens each: one batch
        answers = model.greedy(torch.tensor([p[4] for p in group], device=device), 8)
        for (length, depth, key, distance, _), ids in zip(group, answers):
            answer = tokenizer.decode(ids)
            found = re.search(r"\d{5}", answer.replace(" ", ""))
            trials.append({"length": length, "depth": depth, "distance": distance, "key": key,
                           "answer": answer, "correct": bool(found and found[0] == key)})
    result = {"loss": loss.mean().item(), "loss_below_w": loss[:, :window].mean().item(),
              "loss_from_w": loss[:, window:].mean().item(), "passkey": trials}
    per_length = ", ".join(f"{n}: {sum(t['correct'] for t in trials if t['length'] == n)}/"
                           f"{sum(t['length'] == n for t in trials)}" for n in lengths)
    print(f"{model.label}: loss {result['loss']:.4f} (positions < {window}: "
          f"{result['loss_below_w']:.4f}, >= {window}: {result['loss_from_w']:.4f}, "
          f"T = {docs.size(1)}); passkey {per_length} ({time.time() - t0:.0f} s)", flush=True)
    return result


def evaluate(models, tokenizer, args, device):
    """{label: measure(...)} for each Model, on the standard library's held-out files."""
    named = held_out_documents(tokenizer, args.docs, args.seq_len)
    docs, prompts = torch.tensor([ids for _, ids in named]), passkey_prompts(tokenizer, args.keys)
    results = {"documents": [name for name, _ in named], "window": args.window,
               "seq_len": args.seq_len}
    for model in models:
        results[model.label] = measure(model, docs, prompts, tokenizer, args.window, device)
        del model  # before the generator builds the next
    return results


def save(step, record, device, path=None):
    suffix = "" if torch.device(device).type == "cuda" else f"_{torch.device(device).type}"
    path = path or REPO / "results" / f"smollm2_{step}{suffix}.json"
    record = {**record, "meta": run_meta(device), "command": " ".join(sys.argv)}
    atomic_write(path, lambda f: f.write(json.dumps(record, indent=1) + "\n"), mode="w")
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python repro/smollm2.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["eval", "cpt", "plot", "prefill"],
                        help="plot: cpt's plot again, from --out_dir's cpt.json alone")
    parser.add_argument("--hf", default=str(SMOLLM2_DIR), help="the folder from_gguf.py writes")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--docs", type=int, default=16, help="held-out documents for the loss")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=KEYS_PER_CELL, help="per (length, depth)")
    group = parser.add_argument_group("cpt")
    group.add_argument("--data", default=str(REPO / "data" / "docs"), help="a prepared dataset")
    group.add_argument("--attns", default=",".join(ATTNS), help="the models to train")
    group.add_argument("--steps", type=int, default=1040, help="optimizer steps of each run")
    group.add_argument("--curve", default="0.1,0.25,0.5", help="measure here too: shares of steps")
    group.add_argument("--compile", default="true", help="train.py's --compile")
    group.add_argument("--batch_size", type=int, default=8, help="sequences per micro-step")
    group.add_argument("--grad_accum", type=int, default=2, help="micro-steps per step")
    group.add_argument("--lr", type=float, default=1e-4, help="peak: 10%% warm-up, cosine to 10%%")
    group.add_argument("--long_steps", type=int, default=30, help="steps at --long_seq_len, or 0")
    group.add_argument("--long_seq_len", type=int, default=LONG, help="T of the long stage")
    group.add_argument("--long_lr", type=float, default=3e-5, help="its peak learning rate")
    group.add_argument("--out_dir", default=str(REPO / "out" / "smollm2-cpt"), help="runs, record")
    parser.add_argument("--lengths", default="32768,131072", help="prefill: prompt lengths")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="eval: the file to write (default: out/smollm2_eval_*.json)")
    args = parser.parse_args(argv)
    device, hf = pick_device(args.device), f"hf:{Path(args.hf).resolve()}"
    if args.step == "plot":  # from the record alone: no model, no data
        return plot(json.loads((Path(args.out_dir) / "cpt.json").read_text()),
                    Path(args.out_dir) / "cpt.png")
    tokenizer = get_tokenizer(hf)
    if args.step == "eval":
        models = [("original", hf, "hf"), ("orthros", hf, "orthros"), ("swa", hf, "swa")]
        out = args.out or REPO / "out" / f"smollm2_eval_{torch.device(device).type}.json"
        record = evaluate((Model(*m, args.window, device) for m in models), tokenizer, args, device)
        save("eval", record, device, out)
    elif args.step == "cpt":
        cpt(args, hf, tokenizer, device)
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        save("prefill", prefill_times(hf, lengths, args.window, device), device)


def cpt(args, hf, tokenizer, device):
    """The curves, then the long stage: each result enters cpt.json at once, and only once."""
    out, attns, long = Path(args.out_dir), args.attns.split(","), args.long_seq_len
    if set(attns) - set(ATTNS) or not (Path(args.data) / "val.bin").is_file():
        raise SystemExit(f"error: --attns takes {', '.join(ATTNS)}; --data a prepared dataset "
                         f"(python data/docs/prepare.py --tokenizer {hf})")
    path, tokens = out / "cpt.json", args.batch_size * args.grad_accum * args.seq_len  # per step
    record = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault("calls", []).append({"command": " ".join(sys.argv), **run_meta(device)})
    meta = {k: v for k, v in load_meta(args.data).items() if k not in ("val_files", "tokenizer")}
    record.update(window=args.window, tokens_per_step=tokens, data=str(args.data), data_meta=meta)
    sets = {T: (val_documents(args.data, args.docs, T), passkey_prompts(tokenizer, args.keys, 0, n))
            for T, n in ((args.seq_len, LENGTHS), (long, (long // 2, long - 8)))}  # + 8 new tokens

    def measured(keys, label, source, attn=None, T=args.seq_len):  # record[keys[0]][keys[1]]...
        node = record
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if keys[-1] not in node:
            model = Model(label, source, attn, args.window, device)
            node[keys[-1]] = measure(model, *sets[T], tokenizer, args.window, device)
            write_json_atomic(path, record)  # now: a call stopped by its time limit keeps it

    measured(["original", str(args.seq_len)], "original", hf, "hf")
    measured(["original", str(long)], "original", hf, "hf", long)
    curve = sorted({0, args.steps, *(round(float(f) * args.steps) for f in args.curve.split(","))})
    for attn in attns:  # all curves before any long stage: if time runs out, the curves are done
        measured([attn, "curve", "0"], attn, hf, attn)
        record[attn]["train"] = train_run(args, attn, hf, out / attn, args.seq_len,
                                          args.batch_size, args.steps, args.lr, curve, args.compile)
        for step in curve[1:]:
            kept = str(out / attn / f"ckpt_{step}.pt")
            measured([attn, "curve", str(step)], f"{attn} at step {step}", kept)
        write_json_atomic(path, record)
    plot(record, out / "cpt.png")
    for attn in attns if args.long_steps else ():
        last, long_dir = out / attn / f"ckpt_{args.steps}.pt", out / f"{attn}-{long}"
        measured([attn, str(long), "before"], f"{attn} before T = {long}", str(last), T=long)
        record[attn][f"train_{long}"] = train_run(  # too short to earn a compilation back
            args, attn, last, long_dir, long, max(1, tokens // args.grad_accum // long),
            args.long_steps, args.long_lr, [0, args.long_steps], "false")
        measured([attn, str(long), "after"], f"{attn} after T = {long}",
                 str(long_dir / f"ckpt_{args.long_steps}.pt"), T=long)
        write_json_atomic(path, record)


def train_run(args, attn, init, out, seq_len, batch_size, steps, lr, curve, compiled):
    """train.py from init into out, resumed; its settings, val losses, median tokens/s a segment."""
    if not (out / f"ckpt_{steps}.pt").exists():
        start = (["--init_from", "resume"] if (out / "ckpt_last.pt").exists()
                 else ["--init_from", str(init), "--overwrite", "true"])
        options = dict(dataset=args.data, data_order="epoch", attn=attn, window=args.window,
                       seq_len=seq_len, batch_size=batch_size, grad_accum=args.grad_accum,
                       max_iters=steps, lr=lr, warmup_iters=max(1, steps // 10),
                       eval_interval=steps, eval_iters=5, log_interval=10, compile=compiled,
                       keep_steps=",".join(map(str, curve[1:])), out_dir=out)
        cmd = [sys.executable, "train.py", *start, *(f"--{k}={v}" for k, v in options.items())]
        print("$ " + " ".join(cmd), flush=True)
        # A time limit's SIGTERM (timeout signals the whole process group) lets train.py finish its
        # step and save; this script waits for it (exec resets the handler for the child).
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            done = subprocess.run(cmd, cwd=REPO)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if done.returncode:
            raise SystemExit(f"train.py stopped (exit code {done.returncode}); run again to resume")
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    speeds = lambda a, b: [r["tok_per_s"] for r in logs  # past step 10: compiling
                           if max(a, 10) < r["step"] <= b and "tok_per_s" in r] or [None]
    evals = [(r["step"], r["val_loss"]) for r in logs if "val_loss" in r]
    speed = {str(b): statistics.median(speeds(a, b)) for a, b in zip(curve, curve[1:])}
    return dict(init_from=str(init), seq_len=seq_len, steps=steps, lr=lr, compile=compiled,
                val_loss=evals, tok_per_s=speed)


def plot(record, path):
    """Loss past the window, passkey (300 to 2,000 tokens) against CPT tokens: a line per model."""
    try:
        import matplotlib  # here: the GPU machine has it, the tests need not
    except ImportError:
        return print(f"no plot: no matplotlib here (repro/smollm2.py plot makes {path} later)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (loss_ax, key_ax) = plt.subplots(1, 2, figsize=(11, 4))
    w = record["window"]
    names = {"orthros": f"Orthros (w = {w})", "transformer": "Base CPT", "swa": f"SWA (w = {w})"}
    for attn in (a for a in ATTNS if a in record):
        steps = sorted(map(int, record[attn]["curve"]))
        x = [step * record["tokens_per_step"] / 1e6 for step in steps]
        points = [record[attn]["curve"][str(step)] for step in steps]
        loss_ax.plot(x, [p["loss_from_w"] for p in points], marker="o", label=names[attn])
        found = [sum(t["correct"] for t in p["passkey"]) for p in points]
        key_ax.plot(x, found, marker="o", label=names[attn])
    original = record["original"][min(record["original"], key=int)]  # at the curve's T
    loss_ax.axhline(original["loss_from_w"], color="gray", ls="--", label="original, no CPT")
    found = sum(t["correct"] for t in original["passkey"])
    key_ax.axhline(found, color="gray", ls="--", label="original, no CPT")
    loss_ax.set(xlabel="CPT tokens (millions)", ylabel=f"held-out loss at positions >= {w} (nats)")
    key_ax.set(xlabel="CPT tokens (millions)", ylabel="passkey at 300-2,000 tokens: keys found",
               ylim=(-0.5, len(original["passkey"]) + 0.5))
    for ax in (loss_ax, key_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    print(f"wrote {path}")


@torch.no_grad()
def prefill_times(hf, lengths, window, device, reps=5):
    """Median seconds of model.prefill (bf16) at each length: Orthros at window w, Transformer."""
    ckpt, times = load_checkpoint(hf), {}
    for attn in ("orthros", "transformer"):
        model = model_from_checkpoint(ckpt, attn=attn, window=window, max_seq_len=max(lengths))
        model = model.to(device, torch.bfloat16).eval()
        for n in lengths:
            idx = torch.randint(0, model.config.vocab_size, (1, n), device=device)
            model.prefill(idx)  # first call: FlexAttention's compilation
            samples = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.prefill(idx)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            times[f"{attn}_{n}"] = sorted(samples)[reps // 2]
            print(f"{attn} prefill at {n} tokens: {times[f'{attn}_{n}'] * 1000:.1f} ms", flush=True)
        del model
    speedup = {n: times[f"transformer_{n}"] / times[f"orthros_{n}"] for n in lengths}
    return {"seconds": times, "speedup": speedup}


if __name__ == "__main__":
    main()
