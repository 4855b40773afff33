"""
Reproduce the paper's claims at classroom scale, with our own train.py and sample.py.

    python experiments.py lm           # LM quality: transformer, swa, orthros, orthros w/o SO (Table 1, Fig. 2)
    python experiments.py recall       # recall by distance (Table 3)
    python experiments.py niah         # needle-in-a-haystack grid for the recall step's Orthros model
    python experiments.py conversion   # transformer -> orthros vs. continued transformer (Table 2)
    python experiments.py inference    # time to first token and decode speed of the LM models (Table 4)
    python experiments.py plots        # PNGs from the JSONs (needs matplotlib)
    python experiments.py recall niah --scale cpu   # the recall_tiny version (window 32), CPU minutes
    python experiments.py all --scale tiny          # every step, tiny: a smoke test

Each step runs the same commands a user would (python train.py ..., python sample.py ...),
several at once on one GPU, reads what they wrote, and saves results/<step>.json with the GPU,
torch version, date and the commands. The models go to out/exp-*/. Steps build on each other:
conversion and inference reuse the lm and recall models.
"""

import argparse
import datetime
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from checkpoint import load_checkpoint, model_from_checkpoint
from data.prepare_utils import ensure_prepared
from data.recall.prepare import make_example
from data.sft import encode_example, exact_match
from data.tokenizer import get_tokenizer

RESULTS = Path("results")
LM_MODELS = {"transformer": ["--attn", "transformer"], "swa": ["--attn", "swa"],
             "orthros": ["--attn", "orthros"], "orthros_noso": ["--attn", "orthros", "--scale_offset", "false"]}
RECALL_MODELS = ("transformer", "swa", "orthros")
# How long each run is: "gpu" is sized for minutes on one H200, "tiny" for a CPU smoke test.
SCALES = {
    "gpu": dict(lm=["--config", "small", "--max_iters", "1500"], recall=["--config", "recall"], cont_frac=0.25,
                niah_lens=[256, 512, 1024, 2048], niah_n=40, prompt_lens=[32768], new_tokens=128),
    # CPU scale, for the recall and NIAH results when no GPU time is left: recall_tiny (window 32)
    "cpu": dict(lm=["--config", "tiny"], recall=["--config", "recall_tiny"], cont_frac=0.25,
                niah_lens=[64, 128, 256, 300, 512, 1024], niah_n=40, prompt_lens=[4096], new_tokens=64),
    "tiny": dict(lm=["--config", "tiny", "--max_iters", "60", "--eval_interval", "30"],
                 recall=["--config", "recall_tiny", "--max_iters", "60", "--eval_interval", "30",
                         "--eval_exact_match", "40"],
                 cont_frac=0.5, niah_lens=[64, 128], niah_n=4, prompt_lens=[512], new_tokens=8),
}


def run_all(commands, logs):
    """Run the commands, at once on a GPU (they share it), one by one on CPU (they would fight
    over its cores); stop if one fails."""
    procs = []
    for cmd, log in zip(commands, logs):
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        print("$", " ".join(cmd), flush=True)
        procs.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT), cmd, log))
        if not torch.cuda.is_available():
            procs[-1][0].wait()
    for p, cmd, log in procs:
        if p.wait() != 0:
            sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}; see {log}")


def train_cmds(runs, base, scale_args):
    """{name: extra args} -> the train.py commands writing to out/exp-<base>-<name>."""
    return {name: [sys.executable, "train.py", *scale_args, *extra, "--out_dir", f"out/exp-{base}-{name}"]
            for name, extra in runs.items()}


def launch(cmds):
    run_all(list(cmds.values()), [f"{c[-1]}/stdout.log" for c in cmds.values()])


def read_log(out_dir):
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    return {"val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
            "train": [(r["step"], r["loss"]) for r in records if "loss" in r]}


def meta(commands):
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "commands": [" ".join(c) for c in commands]}


def save(name, obj, scale):
    """results/<name>.json at GPU scale, results/<name>_<scale>.json otherwise."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / (f"{name}.json" if scale["name"] == "gpu" else f"{name}_{scale['name']}.json")
    path.write_text(json.dumps(obj, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


# -----------------------------------------------------------------------------
# The steps

def step_lm(scale):
    """Equal tokens for the four models on the default corpus; the val-loss curves."""
    ensure_prepared("stdlib")  # once, before the concurrent runs would each try
    cmds = train_cmds(LM_MODELS, "lm", scale["lm"])
    launch(cmds)
    curves = {name: read_log(cmd[-1]) for name, cmd in cmds.items()}
    final = {name: {"final_val_loss": c["val"][-1][1], "best_val_loss": min(v for _, v in c["val"])}
             for name, c in curves.items()}
    save("lm", {"meta": meta(cmds.values()), "final": final, "curves": curves}, scale)


def step_recall(scale):
    """Recall by distance for the three models (window 128 at GPU scale)."""
    ensure_prepared("recall" if "recall" in scale["recall"] else "recall_tiny")
    cmds = train_cmds({a: ["--attn", a] for a in RECALL_MODELS}, "recall", scale["recall"])
    launch(cmds)
    accuracy = {a: json.loads((Path(cmd[-1]) / "exact_match.json").read_text()) for a, cmd in cmds.items()}
    window = load_checkpoint(Path(cmds["orthros"][-1]) / "ckpt_last.pt")["model_config"]["window"]
    save("recall", {"meta": meta(cmds.values()), "window": window, "accuracy": accuracy}, scale)


def step_niah(scale, depths=(0.0, 0.25, 0.5, 0.75, 1.0)):
    """A needle-in-a-haystack grid for the recall step's Orthros model: exact-match accuracy for
    one queried pair at each context length and depth (0 = the start of the context, 1 = just
    before the query). The recall step's Transformer gets the same grid, for reference."""
    context_lens, n_per_cell = scale["niah_lens"], scale["niah_n"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng, examples = random.Random(0), []
    tok = get_tokenizer("byte")
    for L in context_lens:
        for depth in depths:
            # the needle's key sits at depth * (L - 2); its distance to the query is then:
            distance = L + 1 - round(depth * (L - 2))
            for _ in range(n_per_cell):
                ex = make_example(rng, L, n_pairs=8, n_queries=1, n_keys=26, n_values=26, first_distance=distance)
                tokens, mask = encode_example(ex["turns"], tok)
                examples.append({"tokens": tokens, "mask": mask, "bucket": f"{L}:{depth}"})
    grids = {}
    for attn in ("orthros", "transformer"):
        ckpt = load_checkpoint(f"out/exp-recall-{attn}/ckpt_last.pt")
        model = model_from_checkpoint(ckpt, max_seq_len=max(context_lens) + 8).to(device).eval()

        @torch.no_grad()
        def generate(prompts, n):
            idx = torch.tensor(prompts, device=device)
            return model.generate(idx, n, temperature=0)[:, idx.size(1):].tolist()
        scores = exact_match(examples, generate)
        grids[attn] = [[scores[f"{L}:{d}"]["accuracy"] for d in depths] for L in context_lens]
    save("niah", {"meta": meta([]), "window": ckpt["model_config"]["window"],
                  "trained_context": ckpt["train_config"]["seq_len"], "n_per_cell": n_per_cell,
                  "context_lens": list(context_lens), "depths": list(depths),
                  "accuracy": grids["orthros"], "transformer_accuracy": grids["transformer"]}, scale)


def step_conversion(scale):
    """Table 2 at toy scale. The base is the lm (and recall) transformer after N steps; then
    (a) converted to orthros and trained M more steps, (b) the transformer trained M more steps
    (Base CPT), (c) the converted model with no training at all."""
    out = {}
    for task in ("lm", "recall"):
        base = Path(f"out/exp-{task}-transformer/ckpt_last.pt")
        n_steps = load_checkpoint(base)["step"]
        m_steps = max(1, int(n_steps * scale["cont_frac"]))
        extra = ["--init_from", str(base), "--warmup_iters", str(max(1, m_steps // 10)),
                 "--eval_interval", str(m_steps), "--curriculum="]  # continue on the full task
        runs = {"a_orthros_converted": ["--attn", "orthros", "--max_iters", str(m_steps)],
                "b_transformer_cpt": ["--attn", "transformer", "--max_iters", str(m_steps)],
                "c_orthros_untrained": ["--attn", "orthros", "--max_iters", "0"]}
        cmds = train_cmds(runs, f"conv-{task}", scale[task] + extra)
        launch(cmds)
        rows = {}
        for name, cmd in cmds.items():
            log = read_log(cmd[-1])
            row = {"val_loss_before": log["val"][0][1], "val_loss_after": log["val"][-1][1]}
            em = Path(cmd[-1]) / "exact_match.json"
            if em.exists():
                row["exact_match"] = json.loads(em.read_text())
            rows[name] = row
        rows["base_transformer"] = {"val_loss_after": read_log(base.parent)["val"][-1][1], "steps": n_steps}
        out[task] = {"N": n_steps, "M": m_steps, "rows": rows, "commands": [" ".join(c) for c in cmds.values()]}
    save("conversion", {"meta": meta([]), **out}, scale)


def step_inference(scale):
    """sample.py on each trained LM model at long prompts: time to first token, decode tokens/s."""
    text = "".join(p.read_text(errors="replace") for p in sorted(Path(sys.prefix).rglob("*.py"))[:400])
    rows, cmds = [], []
    for T in scale["prompt_lens"]:
        prompt = Path(f"out/exp-prompt-{T}.txt")
        prompt.write_text(text[:T])  # byte tokenizer: T characters of ASCII-ish code ~ T tokens
        for name in LM_MODELS:
            cmd = [sys.executable, "sample.py", "--ckpt", f"out/exp-lm-{name}/ckpt_last.pt", "--prompt_file",
                   str(prompt), "--max_new_tokens", str(scale["new_tokens"]), "--temperature", "0", "--warmup"]
            cmds.append(cmd)
            printed = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            m = re.search(r"prompt (\d+) tokens; time to first token ([\d.]+) ms; decode ([\d,.]+) tokens/s", printed)
            rows.append({"model": name, "prompt_tokens": int(m[1]), "ttft_ms": float(m[2]),
                         "decode_tokens_per_s": float(m[3].replace(",", ""))})
            print(rows[-1], flush=True)
    save("inference", {"meta": meta(cmds), "rows": rows}, scale)


# -----------------------------------------------------------------------------
# Plots (optional: matplotlib is not a dependency of the repo)

def step_plots(scale):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    suffix = "" if scale["name"] == "gpu" else f"_{scale['name']}"
    load = lambda name: json.loads((RESULTS / f"{name}{suffix}.json").read_text()) \
        if (RESULTS / f"{name}{suffix}.json").exists() else None
    if lm := load("lm"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, c in lm["curves"].items():
            steps, losses = zip(*c["val"][1:])  # skip step 0: the untrained loss squashes the plot
            ax.plot(steps, losses, label=name)
        ax.set(xlabel="step", ylabel="val loss (nats per byte)", title=f"LM on the stdlib corpus ({lm['meta']['device']})")
        ax.legend(), ax.grid(alpha=0.3), fig.tight_layout(), fig.savefig(RESULTS / f"lm_val_loss{suffix}.png", dpi=120)
    if rec := load("recall"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, acc in rec["accuracy"].items():
            ax.plot(range(len(acc)), [a["accuracy"] for a in acc.values()], marker="o", label=name)
        buckets = list(next(iter(rec["accuracy"].values())))
        ax.set_xticks(range(len(buckets)), buckets, rotation=30)
        ax.set(xlabel="distance from the query back to its key (tokens)", ylabel="exact match", ylim=(-0.02, 1.02),
               title=f"In-context recall by distance (window {rec['window']}, {rec['meta']['device']})")
        ax.legend(), ax.grid(alpha=0.3), fig.tight_layout(), fig.savefig(RESULTS / f"recall_by_distance{suffix}.png", dpi=120)
    if grid := load("niah"):
        fig, ax = plt.subplots(figsize=(5.5, 4))
        im = ax.imshow(grid["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_yticks(range(len(grid["context_lens"])), grid["context_lens"])
        ax.set_xticks(range(len(grid["depths"])), grid["depths"])
        for i, row in enumerate(grid["accuracy"]):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
        ax.set(xlabel="needle depth (0 = start of the context)", ylabel="context length (tokens)",
               title=f"Orthros, needle in a haystack\n(window {grid['window']}, trained on {grid['trained_context']} tokens)")
        fig.colorbar(im), fig.tight_layout(), fig.savefig(RESULTS / f"niah_orthros{suffix}.png", dpi=120)
    if conv := load("conversion"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        names = ["base_transformer", "c_orthros_untrained", "a_orthros_converted", "b_transformer_cpt"]
        labels = ["base\n(N steps)", "(c) converted,\nuntrained", "(a) converted\n+M steps", "(b) base CPT\n+M steps"]
        rows = conv["lm"]["rows"]
        axes[0].bar(labels, [rows[n]["val_loss_after"] for n in names], color=["gray", "tab:olive", "tab:green", "tab:blue"])
        lo = min(rows[n]["val_loss_after"] for n in names)
        axes[0].set(ylabel="val loss", ylim=(lo * 0.97, None), title=f"LM (N={conv['lm']['N']}, M={conv['lm']['M']})")
        axes[0].tick_params(axis="x", labelsize=8)
        recall_rows = conv["recall"]["rows"]
        for n, label in zip(names[1:], labels[1:]):
            acc = recall_rows[n]["exact_match"]
            axes[1].plot(range(len(acc)), [a["accuracy"] for a in acc.values()], marker="o", label=label.replace("\n", " "))
            axes[1].set_xticks(range(len(acc)), list(acc), rotation=30)
        axes[1].set(ylabel="exact match", ylim=(0.8, 1.01), title=f"recall (N={conv['recall']['N']}, M={conv['recall']['M']})")
        axes[1].legend(fontsize=7), fig.tight_layout(), fig.savefig(RESULTS / f"conversion{suffix}.png", dpi=120)
    if inf := load("inference"):
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        models = [r["model"] for r in inf["rows"]]
        axes[0].bar(models, [r["ttft_ms"] for r in inf["rows"]])
        axes[0].set(ylabel="ms", title=f"time to first token ({inf['rows'][0]['prompt_tokens']}-token prompt)")
        axes[1].bar(models, [r["decode_tokens_per_s"] for r in inf["rows"]])
        axes[1].set(ylabel="tokens/s", title="decode (batch 1)")
        for ax in axes:
            ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout(), fig.savefig(RESULTS / f"inference{suffix}.png", dpi=120)
    print(f"plots in {RESULTS}/")


STEPS = {"lm": step_lm, "recall": step_recall, "niah": step_niah, "conversion": step_conversion,
         "inference": step_inference, "plots": step_plots}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="+", choices=[*STEPS, "all"])
    parser.add_argument("--scale", default="gpu", choices=list(SCALES))
    args = parser.parse_args()
    for name in (list(STEPS) if "all" in args.steps else args.steps):
        t0 = time.time()
        STEPS[name]({"name": args.scale, **SCALES[args.scale]})
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)
