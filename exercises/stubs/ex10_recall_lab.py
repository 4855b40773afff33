"""Exercise 10: the recall lab. Train SWA and Orthros on the recall task, then summarize.

The task (data/recall/prepare.py): key-value pairs such as "Qk" hidden in random filler, then a
query "?Q" whose answer is "k". The test split asks one query per example, at a controlled
distance, grouped into buckets ("1-32", "32-64", ...: distances lo <= d < hi, in tokens).

1. Train both models (3-4 minutes each on 2 idle CPU cores; keep recall_tiny's 2400 steps: shorter
   schedules did not learn recall in our tries). Each run ends by writing exact_match.json (the
   accuracy of greedy answers per bucket) beside its checkpoints:

       python train.py --config recall_tiny --attn swa --out_dir out/lab-recall-swa
       python train.py --config recall_tiny --attn orthros --out_dir out/lab-recall-orthros

2. Write recall_summary(run_dir) from exact_match.json and the checkpoint's model config
   (checkpoint.load_checkpoint(path)["model_config"]).

The checker compares yours with the stored solution on made-up runs, then on your two runs, and
checks what the lab should show: SWA near chance beyond n_layer * window, Orthros answering there.
Until both runs exist it waits for them. Other runs: check 10 --runs swa=DIR,orthros=DIR
"""

import json
from pathlib import Path

from checkpoint import load_checkpoint


def recall_summary(run_dir):
    """A dict for the run in run_dir (a str or pathlib.Path: a folder with exact_match.json and
    ckpt_last.pt):
        "attn", "window", "n_layer": from the checkpoint's model config;
        "inside": the accuracy over all test examples of the buckets with hi <= window;
        "beyond": the accuracy over all test examples of the buckets with lo >= n_layer * window.
    Pool over examples: a bucket of 300 examples weighs three times one of 100."""
    raise NotImplementedError
