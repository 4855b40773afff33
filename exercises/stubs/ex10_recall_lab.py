"""Exercise 10: the recall lab. Train SWA and Orthros on the recall task, then summarize.

The task (data/recall/prepare.py): key-value pairs such as "Qk" hidden in random filler, then a
query "?Q" whose answer is "k". The test split asks one query per example, at a controlled
distance, grouped into buckets ("1-32", "32-64", ...: distances lo <= d < hi, in tokens).

1. Train both models on this laptop (3-4 minutes each on 2 idle CPU cores, longer on a busy
   machine; keep the recall_tiny config's 2400-step schedule: shorter ones did not learn recall
   in our tries):

       python train.py --config recall_tiny --attn swa --out_dir out/lab-recall-swa
       python train.py --config recall_tiny --attn orthros --out_dir out/lab-recall-orthros

   Each run ends by writing exact_match.json (the accuracy of greedy answers per bucket) next to
   its checkpoints.
2. Write recall_summary(run_dir): read the run's exact_match.json and the model config stored in
   its checkpoint (checkpoint.load_checkpoint(path)["model_config"]: "attn", "window",
   "n_layer", ...), and pool the accuracy of the buckets inside the window and of those beyond
   n_layer * window, the farthest a sliding-window model can reach.

The checker runs yours on made-up runs first, then on your two trained runs, compares it with the
stored solution (live, on the same files), and checks what the lab should show: SWA is near
chance beyond n_layer * window; Orthros answers there.
Until both runs exist the check says it is waiting for them. Other run folders:
python -m exercises check 10 --runs swa=DIR,orthros=DIR

    python -m exercises start 10      (your own copy: exercises/mine/ex10_recall_lab.py)
    python -m exercises check 10      python -m exercises hint 10
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
