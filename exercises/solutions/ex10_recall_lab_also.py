import json
from pathlib import Path

from checkpoint import load_checkpoint


def recall_summary(run_dir):
    config = load_checkpoint(Path(run_dir) / 'ckpt_last.pt')['model_config']
    with open(Path(run_dir) / 'exact_match.json') as f:
        buckets = json.load(f)
    w, L = config['window'], config['n_layer']
    inside, beyond = [0, 0], [0, 0]
    for name, r in buckets.items():
        lo, hi = (int(x) for x in name.split('-'))
        for pool, keep in ((inside, hi <= w), (beyond, lo >= L * w)):
            if keep:
                pool[0] += round(r['accuracy'] * r['n'])
                pool[1] += r['n']
    return dict(attn=config['attn'], window=w, n_layer=L, inside=inside[0] / inside[1], beyond=beyond[0] / beyond[1])
