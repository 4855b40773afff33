"""Exercise 10, the stored solution: a recall run, summarized."""

import json
from pathlib import Path

from checkpoint import load_checkpoint


def recall_summary(run_dir):
    run_dir = Path(run_dir)
    config = load_checkpoint(run_dir / "ckpt_last.pt")["model_config"]
    scores = json.loads((run_dir / "exact_match.json").read_text())
    w, reach = config["window"], config["n_layer"] * config["window"]

    def pooled(keep):  # hits / examples over the buckets "lo-hi" that keep(lo, hi) selects
        chosen = [r for name, r in scores.items() if keep(*map(int, name.split("-")))]
        return sum(r["accuracy"] * r["n"] for r in chosen) / sum(r["n"] for r in chosen)

    return {"attn": config["attn"], "window": w, "n_layer": config["n_layer"],
            "inside": pooled(lambda lo, hi: hi <= w), "beyond": pooled(lambda lo, hi: lo >= reach)}
