"""
A real pretrained model converted into Orthros: SmolLM2-135M-Instruct (convert/from_gguf.py), before and
after continued pre-training (CPT), as in the paper's section 4.3 and Table 2, at small scale.

    python repro/smollm2.py eval                  # before any training, CPU: the original, Orthros and SWA
    python repro/smollm2.py cpt --steps 300       # one GPU: CPT of Orthros, the Transformer and SWA, then both evals
    python repro/smollm2.py prefill               # one GPU: the converted model's prefill against the Transformer's

eval measures, for each model, on the same held-out text:
  - loss: the mean next-token loss on the first T = 2048 tokens of long held-out files of the Python standard
    library (the val split of data/stdlib/prepare.py's rule, so CPT never trains on them), apart for
    positions < w (where a base token sees its whole past: identical by construction) and >= w;
  - passkey: a 5-digit key hidden at depths 10% ... 90% of 300 to 2,000 tokens of filler, then "What is the
    pass key? The pass key is"; the greedy answer's first five digits must be the key (exact match). Each
    trial records how far the key lies from the question, so retrieval inside and beyond the window show apart.
The models: "original" is transformers' own LlamaForCausalLM; "orthros" and "swa" are built from the same
weights at window w (identity scale-offsets; SWA drops the output stream). cpt trains each with train.py on the
standard library's train split (--attn orthros | transformer | swa, the same steps and data) and evaluates them.
Each step writes results/smollm2_<step>[_<device>].json with its commands, device, date and commit;
eval writes out/smollm2_eval_<device>.json (or --out FILE): a re-run keeps the committed one.
"""

import argparse
import json
import random
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: import from the repository root
from checkpoint import load_checkpoint, model_from_checkpoint, pick_device
from convert.from_gguf import SMOLLM2_DIR
from data.prepare_utils import atomic_write
from data.stdlib.prepare import find_files, is_val
from data.tokenizer import get_tokenizer
from checkpoint import run_meta

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
LENGTHS, DEPTHS, KEYS_PER_CELL = (300, 600, 1200, 2000), (0.1, 0.3, 0.5, 0.7, 0.9), 2


def held_out_documents(tokenizer, n_docs, seq_len):
    """The first seq_len tokens of the first n_docs val files (by path) that hold at least seq_len tokens."""
    src = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for rel in (p for p in find_files(src) if is_val(p, 0.1)):
        ids = tokenizer.encode((src / rel).read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= seq_len:
            docs.append((rel.as_posix(), ids[:seq_len]))
        if len(docs) == n_docs:
            break
    return docs


def passkey_prompts(tokenizer, keys_per_cell=KEYS_PER_CELL, seed=0):
    """(length, depth, key, distance, token ids): the key after depth of the filler, length tokens in all;
    distance = tokens from the key's first digit to the end of the prompt."""
    rng, filler = random.Random(seed), tokenizer.encode(FILLER)
    prompts = []
    for length in LENGTHS:
        for depth in DEPTHS:
            for _ in range(keys_per_cell):
                key = str(rng.randint(10000, 99999))
                intro, needle = tokenizer.encode(INTRO), tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
                question = tokenizer.encode(QUESTION)
                n_fill = length - len(intro) - len(needle) - len(question)
                fill = (filler * (n_fill // len(filler) + 1))[:n_fill]
                before = fill[:int(depth * n_fill)]
                ids = intro + before + needle + fill[len(before):] + question
                prompts.append((length, depth, key, len(ids) - len(intro) - len(before), ids))
    return prompts


class Model:
    """One model to evaluate: logits(idx) over every position, and greedy(idx, n) new tokens."""

    def __init__(self, label, source, attn=None, window=128, device="cpu"):
        self.label, self.device = label, device
        if attn == "hf":  # the original implementation: transformers' model of the folder
            from transformers import AutoModelForCausalLM
            self.hf = AutoModelForCausalLM.from_pretrained(source.removeprefix("hf:"), dtype=torch.float32).to(device).eval()
        else:
            ckpt = load_checkpoint(source)
            overrides = {"attn": attn} if attn else {}
            if (attn or ckpt["model_config"]["attn"]) != "transformer":
                overrides["window"] = window
            self.hf, self.model = None, model_from_checkpoint(ckpt, max_seq_len=4096, **overrides).float().to(device).eval()

    @torch.no_grad()
    def logits(self, idx):
        return self.hf(idx).logits if self.hf is not None else self.model(idx)[0]

    @torch.no_grad()
    def greedy(self, idx, n):
        if self.hf is not None:
            return self.hf.generate(idx, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, idx.size(1):].tolist()
        return self.model.generate(idx, n, temperature=0)[0, idx.size(1):].tolist()


def evaluate(models, tokenizer, args, device):
    """{label: {"loss_below_w", "loss_from_w", "loss", "passkey": [per trial]}} for each Model."""
    docs, prompts, window = held_out_documents(tokenizer, args.docs, args.seq_len), passkey_prompts(tokenizer, args.keys), args.window
    results = {"documents": [name for name, _ in docs], "window": window, "seq_len": args.seq_len}
    for model in models:
        t0, losses = time.time(), []
        for _, ids in docs:
            idx = torch.tensor([ids], device=device)
            logits = model.logits(idx)[0, :-1].float()
            losses.append(F.cross_entropy(logits, idx[0, 1:], reduction="none").cpu())  # position t predicts token t+1
        loss = torch.stack(losses)  # (docs, T - 1)
        trials = []
        for length, depth, key, distance, ids in prompts:
            answer = tokenizer.decode(model.greedy(torch.tensor([ids], device=device), 8))
            found = re.search(r"\d{5}", answer.replace(" ", ""))
            trials.append({"length": length, "depth": depth, "distance": distance, "key": key, "answer": answer,
                           "correct": bool(found and found[0] == key)})
        results[model.label] = {"loss": loss.mean().item(), "loss_below_w": loss[:, :window].mean().item(),
                                "loss_from_w": loss[:, window:].mean().item(), "passkey": trials}
        print(f"{model.label}: loss {loss.mean():.4f} (positions < {window}: {loss[:, :window].mean():.4f}, >= {window}: "
              f"{loss[:, window:].mean():.4f}); passkey " + ", ".join(
                  f"{n}: {sum(t['correct'] for t in trials if t['length'] == n)}/{sum(t['length'] == n for t in trials)}"
                  for n in LENGTHS) + f" ({time.time() - t0:.0f} s)", flush=True)
        del model
    return results


def save(step, record, device, path=None):
    suffix = "" if torch.device(device).type == "cuda" else f"_{torch.device(device).type}"
    path = path or REPO / "results" / f"smollm2_{step}{suffix}.json"
    atomic_write(path, lambda f: f.write(json.dumps({**record, "meta": run_meta(device), "command": " ".join(sys.argv)}, indent=1) + "\n"), mode="w")
    print(f"wrote {path}")


def run(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, check=True, **kw)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python repro/smollm2.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["eval", "cpt", "prefill"])
    parser.add_argument("--hf", default=str(SMOLLM2_DIR), help="the Hugging Face folder (python convert/from_gguf.py writes it)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--docs", type=int, default=16, help="held-out documents for the loss")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=KEYS_PER_CELL, help="passkey: keys per (length, depth)")
    parser.add_argument("--steps", type=int, default=300, help="cpt: optimizer steps of each run")
    parser.add_argument("--compile", default="true", help="cpt: train.py's --compile")
    parser.add_argument("--batch_size", type=int, default=8, help="cpt: sequences of seq_len tokens per step")
    parser.add_argument("--lr", type=float, default=1e-4, help="cpt: peak learning rate")
    parser.add_argument("--lengths", default="32768,131072", help="prefill: prompt lengths")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="eval: the file to write (default: out/smollm2_eval_*.json)")
    args = parser.parse_args(argv)
    device, hf = pick_device(args.device), f"hf:{Path(args.hf).resolve()}"
    tokenizer = get_tokenizer(hf)
    if args.step == "eval":
        models = [("original", hf, "hf"), ("orthros", hf, "orthros"), ("swa", hf, "swa")]
        out = args.out or REPO / "out" / f"smollm2_eval_{torch.device(device).type}.json"
        record = evaluate((Model(*m, args.window, device) for m in models), tokenizer, args, device)
        save("eval", record, device, out)
    elif args.step == "cpt":
        data = REPO / "data" / "smollm2_stdlib"
        if not (data / "val.bin").exists():
            run([sys.executable, "data/stdlib/prepare.py", "--tokenizer", hf, "--out_dir", str(data)])
        record = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr}
        before = [("original", hf, "hf"), ("orthros", hf, "orthros"), ("transformer", hf, "transformer"), ("swa", hf, "swa")]
        record["before"] = evaluate((Model(*m, args.window, device) for m in before), tokenizer, args, device)
        save("cpt", record, device)  # after each phase: a run stopped by a time limit keeps what it measured
        runs = {}
        for attn in ("orthros", "transformer", "swa"):
            out = REPO / "out" / f"smollm2-cpt-{attn}"
            cmd = [sys.executable, "train.py", "--init_from", hf, "--dataset", str(data), "--attn", attn, "--window",
                   str(args.window), "--seq_len", str(args.seq_len), "--batch_size", str(args.batch_size), "--max_iters",
                   str(args.steps), "--lr", str(args.lr), "--warmup_iters", str(args.steps // 10), "--eval_interval",
                   str(args.steps), "--eval_iters", "10", "--log_interval", "10", "--compile", args.compile, "--out_dir", str(out),
                   "--overwrite", "true"]
            run(cmd)
            logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            speeds = sorted(r["tok_per_s"] for r in logs if "tok_per_s" in r and r["step"] > 20)  # past the compiling steps
            runs[attn] = out / "ckpt_last.pt"
            record[attn] = {"command": " ".join(cmd[1:]), "val_loss": [(r["step"], r["val_loss"]) for r in logs if "val_loss" in r],
                            "train_tok_per_s_median": speeds[len(speeds) // 2] if speeds else None}
            save("cpt", record, device)
        record["after"] = evaluate((Model(attn, str(path), None, args.window, device) for attn, path in runs.items()),
                                   tokenizer, args, device)
        save("cpt", record, device)
    else:
        save("prefill", prefill_times(hf, [int(n) for n in args.lengths.split(",")], args.window, device), device)


@torch.no_grad()
def prefill_times(hf, lengths, window, device, reps=5):
    """Median seconds of model.prefill (bf16) at each length, Orthros at window w against the Transformer."""
    ckpt, times = load_checkpoint(hf), {}
    for attn in ("orthros", "transformer"):
        model = model_from_checkpoint(ckpt, attn=attn, window=window, max_seq_len=max(lengths)).to(device, torch.bfloat16).eval()
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
    return {"seconds": times, "speedup": {n: times[f"transformer_{n}"] / times[f"orthros_{n}"] for n in lengths}}


if __name__ == "__main__":
    main()
