"""The associative-recall task: key-value pairs hidden in filler, then queries for their values.

    python data/recall/prepare.py                  # window 128 (the `recall` config), here
    python data/recall/prepare.py --preset tiny    # window 32, CPU-sized: data/recall_tiny/
    python data/recall/prepare.py --preset micro   # window 16, seconds on a CPU: data/recall_micro/
    python data/recall/prepare.py --context_len 4000 --test_edges 0,128,256,512,1024,2048,3968

An example, as SFT turns: "4.7;Qk,9:3.;8Hb!;...;;?Q" -> "k", "?H" -> "b", ... A test example has
one query, at a distance (from its key back to the pair) in a bucket of --test_edges (default:
1-w, w-2w, ..., 8w-16w). A share --last_pair_frac of the training examples, from a second random
stream, ask first for the pair flush against the query ("...Kv?K", the needle at depth 1). --preset
sets the other options (PRESETS below), which override it.
"""

import json
import random
import string
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `import data` work from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.prepare_utils import atomic_write, prepare_main, write_json_atomic
from data.tokenizer import get_tokenizer

KEYS, VALUES = string.ascii_uppercase, string.ascii_lowercase
FILLER = string.digits + ".,;:!()"
QUERY = "?"
LAST_PAIR_DISTANCE = 3  # the last pair's key at context_len - 2, the query's at context_len + 1

PRESETS = {
    # window 128: distances to 2048+ (16 windows), the `recall` config (one GPU, minutes)
    "default": dict(window=128, context_len=2100, short_context_len=16, n_pairs=8, n_queries=8,
                    n_short_queries=8, n_keys=26, n_values=26, n_train=6000, n_short=20000,
                    n_val=200, n_test_per_bucket=100, last_pair_frac=0.1),
    # window 32: the same task at a quarter of the scale; the `recall_tiny` config (2 CPU cores)
    "tiny": dict(window=32, context_len=300, short_context_len=16, n_pairs=8, n_queries=8,
                 n_short_queries=4, n_keys=26, n_values=26, n_train=20000, n_short=10000, n_val=200,
                 n_test_per_bucket=100, last_pair_frac=0.1),
    # window 16, chance 1/8: the `recall_micro` config, learnt in seconds (the tests' recall proof)
    "micro": dict(window=16, context_len=40, short_context_len=12, n_pairs=4, n_queries=4,
                  n_short_queries=2, n_keys=4, n_values=8, n_train=4000, n_short=4000, n_val=100,
                  n_test_per_bucket=100, last_pair_frac=0.1),
}


def scatter(rng, length, n):
    """Random starts of n non-overlapping 2-token pairs in `length` tokens (stars and bars)."""
    assert 2 * n <= length, f"{n} pairs do not fit in {length} tokens"
    gaps = sorted(rng.choices(range(length - 2 * n + 1), k=n))  # filler before each pair, cumulated
    return [g + 2 * i for i, g in enumerate(gaps)]


def make_example(rng, context_len, n_pairs, n_queries, n_keys, n_values, first_distance=None):
    """n_pairs "Kv" pairs in context_len tokens, n_queries queries; the first at first_distance."""
    keys = rng.sample(KEYS[:n_keys], n_pairs)
    values = [rng.choice(VALUES[:n_values]) for _ in keys]
    context = [rng.choice(FILLER) for _ in range(context_len)]
    # The query key of turn j sits at context_len + 1 + 4j: each earlier turn adds "?K", v, END.
    query_pos = lambda j: context_len + 1 + 4 * j
    if first_distance is None:
        starts = scatter(rng, context_len, n_pairs)
    else:  # pair 0 at the asked distance; the others scattered before and after it
        start = query_pos(0) - first_distance
        assert 0 <= start <= context_len - 2, f"distance {first_distance} does not fit the context"
        right = context_len - start - 2
        n_left = rng.choice([k for k in range(n_pairs)
                             if 2 * k <= start and 2 * (n_pairs - 1 - k) <= right])
        starts = [start, *scatter(rng, start, n_left),
                  *(start + 2 + s for s in scatter(rng, right, n_pairs - 1 - n_left))]
    for i, start in enumerate(starts):
        context[start], context[start + 1] = keys[i], values[i]
    order = [0] + rng.sample(range(1, n_pairs), n_queries - 1) if first_distance is not None \
        else rng.sample(range(n_pairs), n_queries)
    turns = ["".join(context) + QUERY + keys[order[0]], values[order[0]]]
    for i in order[1:]:
        turns += [QUERY + keys[i], values[i]]
    distances = [query_pos(j) - starts[i] for j, i in enumerate(order)]
    return {"turns": turns, "distances": distances}


def prepare(preset="default", out_dir=None, seed=1337, **overrides):
    """The splits and meta.json into out_dir (default: data/recall/ or data/recall_<preset>/)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {list(PRESETS)}")
    p = {**PRESETS[preset], **overrides}
    if not 0 <= p["last_pair_frac"] <= 1:
        raise ValueError(f"last_pair_frac must be in [0, 1], got {p['last_pair_frac']}")
    w, L = p["window"], p["context_len"]
    edges = [e for e in p.get("test_edges") or [1, w, 2 * w, 4 * w, 8 * w, 16 * w] if e <= L + 1]
    edges = (edges or [1]) + ([L + 2] if (edges or [1])[-1] < L + 1 else [])  # to the start
    shape = dict(n_pairs=p["n_pairs"], n_keys=p["n_keys"], n_values=p["n_values"])
    rng, last_rng = random.Random(seed), random.Random(f"recall-last-pair-{seed}")
    last = set(last_rng.sample(range(p["n_train"]), round(p["last_pair_frac"] * p["n_train"])))
    # rng draws every example (the others stay as at share 0); last_rng replaces the share
    drawn = [make_example(rng, L, n_queries=p["n_queries"], **shape) for _ in range(p["n_train"])]
    train = [make_example(last_rng, L, n_queries=p["n_queries"], first_distance=LAST_PAIR_DISTANCE,
                          **shape) if i in last else ex for i, ex in enumerate(drawn)]
    short = [make_example(rng, p["short_context_len"], **shape, n_queries=p["n_short_queries"])
             for _ in range(p["n_short"])]
    val = [make_example(rng, L, n_queries=p["n_queries"], **shape) for _ in range(p["n_val"])]
    splits = {"train": train, "train_short": short, "val": val, "test": []}
    for lo, hi in zip(edges, edges[1:]):
        for _ in range(p["n_test_per_bucket"]):
            d = rng.randrange(max(lo, 3), min(hi, L + 2))  # a pair needs 2 tokens
            ex = make_example(rng, L, n_queries=1, first_distance=d, **shape)
            splits["test"].append({**ex, "bucket": f"{lo}-{hi}"})
    here = Path(__file__).resolve().parent
    out_dir = Path(out_dir or (here if preset == "default" else here.with_name(f"recall_{preset}")))
    for name, examples in splits.items():
        text = "".join(json.dumps(ex) + "\n" for ex in examples)
        atomic_write(out_dir / f"{name}.jsonl", lambda f: f.write(text), mode="w")
    tok = get_tokenizer("byte")
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "task": "sft", "seed": seed,
            "source": "synthetic associative recall (data/recall/prepare.py)", "preset": preset,
            "params": p, "test_edges": edges, "train_last_pair_examples": len(last),
            **{f"{name}_examples": len(ex) for name, ex in splits.items()}}
    write_json_atomic(out_dir / "meta.json", meta)  # last: if it is there, the splits are whole
    print(f"wrote {out_dir}: " + ", ".join(f"{len(ex)} {name}" for name, ex in splits.items()))
    return meta


if __name__ == "__main__":
    prepare_main(prepare, __doc__, test_edges=lambda edges: [int(e) for e in edges.split(",")],
                 **{key: type(value) for key, value in PRESETS["default"].items()})
