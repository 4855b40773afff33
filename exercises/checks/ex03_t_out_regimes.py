"""Exercise 3, the t_out regimes: the checker."""

import random

import torch

from data.sft import collate
from exercises.framework import Bug, Case, Mutant, tiny_model, tokens
from exercises.solutions import ex03_t_out_regimes as solution

TITLE, DIFFICULTY, MINUTES = "The t_out regimes", 2, 30
FUNCTIONS = ("smallest_t_out", "tokens_through_layers")
REFERENCE = solution   # the stored solution: its functions
FORBIDDEN = {collate: "data/sft.py's own t_out of a batch, which the checker compares yours with"}
PAPER = "sequences of up to 2048 tokens"

HINTS = [
    "The output positions are always a suffix: the last t_out columns. So t_out is decided by the leftmost column that"
    " holds any target, in any row of the batch; everything from there to the end must be an output position. Orthros "
    "runs a second (output) token for each output position; the baselines have one stream.",
    "smallest_t_out: targets (B, T) -> one flag per column, (T,): does any row train this column? The first flagged "
    "column f decides: t_out = T - f. No flagged column: 1 (as prefill). Return a Python int.\n"
    "tokens_through_layers: Orthros runs its T base tokens plus one output token per output position; the baselines "
    "run their T tokens and nothing else.",
    "Paper, section 3.2: Pre-training (T_in = 0, T_out = T), SFT (T_in = T - T_out, T_out >= 1: 'T_out corresponds "
    "exactly to the total length of the target responses'), Prefilling (T_out = 1), Decoding (T = 1). Algorithm 1, "
    "line 1: the input is (T + T_out) x d_model. In the repo: data/sft.py, collate.",
]

FIRST = "    return T - int(columns[0]) if len(columns) else 1"
TRAINED = "(targets != IGNORE)"
BUGS = [
    Bug("counted the targets, not the suffix that holds them", "a row's targets can start earlier than its count says "
        "(right padding, several turns): t_out is T minus the first column with a target.",
        {FIRST: "    return int((targets != IGNORE).sum(dim=1).max())   # how many targets"}),
    Bug("t_out = 0 when nothing is trained", "t_out is at least 1: the model always predicts at the last position "
        "(prefill has t_out = 1).", {"else 1": "else 0"}),
    Bug("2T tokens for Orthros in every regime", "only pre-training (t_out = T) doubles the tokens; SFT, prefill and "
        "decode add just t_out output tokens to the T base tokens.", {"T + t_out if attn": "2 * T if attn"}),
]
MUTANTS = [
    Mutant("the stored solution imported", "is not available to your code",
           source="from exercises.solutions.ex03_t_out_regimes import *\n"),
    Mutant("the checker's live count imported", "is not available to your code",
           {"    return T + t_out": "    from exercises.checks.ex03_t_out_regimes import rows_per_layer\n"
                                    "    return rows_per_layer(attn, 'SFT', T, t_out)\n    return T + t_out"}),
    Mutant("the targets wrapped as examples for data.sft.collate", "called data.sft.collate", {FIRST: "    from data.sft import "
           "collate\n    return collate([{'tokens': [0, *row.clamp(min=0)], 'mask': [0, *(row != IGNORE)]} for row in targets])[2]"}),
    Mutant("targets > 0 taken for the trained ones", "a response that starts with token id 0", {TRAINED: "(targets > 0)"}),
    Mutant("-100 taken for the ignore value", "-1 where nothing is trained", {TRAINED: "(targets != -100)"}),
    Mutant("T from the batch dimension", "targets of shape (B, T) = (1, 2) = [[13, 0]]",
           {"T = targets.size(1)": "T = targets.size(0)"}),
    Mutant("the rows flagged, not the columns", "prompt 4, response 2", {".any(dim=0)": ".any(dim=1)"}),
    Mutant("a tensor returned, not an int", "your t_out is a tensor of shape (1,) (torch.int64), expected an int",
           {"int(columns[0])": "columns[0]"}),
    Mutant("argmax finds column 0 when nothing is trained", "no response at all",
           {FIRST: "    return T - int((targets != IGNORE).any(dim=0).int().argmax())"}),
    Mutant("the targets flagged in place", "changed its input `targets` in place", {TRAINED: "targets.ne_(IGNORE)"}),
    Mutant("an output stream for the sliding-window baseline too", "tokens_through_layers('swa'",
           {'if attn == "orthros"': 'if attn != "transformer"'}),
]


REGIMES = [("pre-training", 12, 12), ("SFT", 12, 5), ("prefill", 12, 1), ("decode", 1, 1), ("pre-training", 2048, 2048),
           ("SFT", 2048, 300)]
SUFFIX = ("t_out is the smallest suffix of columns that holds every target (data.sft.collate's t_out); targets are -1 "
          "where nothing is trained (data.sft.IGNORE), any other value, 0 included, is a target; 1 when nothing is trained")
ROWS = ("the rows of z that the layers process, counted by a hook on the model's first block: Orthros adds one output token "
        "per output position, the baselines have one stream")


def example(turn_lengths, rng):
    """An SFT example as data/sft.py makes it: prompt, response + END, ...; mask True on responses. A response of
    length 0 is no response at all: nothing of the example is trained."""
    ids, mask = [], []
    for i, n in enumerate(turn_lengths):
        response = i % 2 == 1
        if n or not response:
            ids += [rng.randrange(1, 30) for _ in range(n)] + [0] * response   # 0 = END here
            mask += [response] * (n + response)
    return {"tokens": ids, "mask": mask}


def batches():
    rng, other, long = random.Random(0), random.Random(2), random.Random(1)
    found = [(what, [example(lengths, rng) for lengths in batch]) for what, batch in [
        ("one example: prompt 1, response 1", [[1, 1]]), ("one example: prompt 4, response 2", [[4, 2]]),
        ("two examples: prompt 5 + response 1, prompt 1 + response 4 (right-padded)", [[5, 1], [1, 4]]),
        ("one example of two turns: prompt 3, response 2, prompt 2, response 1", [[3, 2, 2, 1]]),
        ("two examples with no response at all (nothing trained)", [[3, 0], [5, 0]])]]
    found += [("a response that starts with token id 0 (a real token: 0 is also END here), prompt 3, response 2",
               [{"tokens": [5, 7, 9, 0, 4, 0], "mask": [False] * 3 + [True] * 3}]),
              ("a pre-training batch of 2: every position trained, the first target token id 0",
               [{"tokens": [3, 0] + list(range(1, 8)), "mask": [True] * 9} for _ in range(2)]),
              ("a batch of 6 examples of 3 or 4 tokens (more rows than columns): a response of 1 in one row only",
               [example([3, 0], other) for _ in range(5)] + [example([2, 1], other)])]
    found += [(f"a random batch of 4 (seed {seed})", [example([rng.randint(1, 9), rng.randint(0, 6)] * rng.randint(1, 2), rng)
                                                     for _ in range(4)]) for seed in range(4)]
    return found + [(f"a random batch of 8 {PAPER} (prompts of 300 to 1800 tokens)", [example(
        [long.randint(300, 1800), long.randint(1, 240)], long) for _ in range(7)] + [example([1800, 247], long)])]


def cases(**options):
    found = []
    for what, batch in batches():
        x, y, t_out = collate(batch)
        found.append(Case(f"smallest_t_out(targets) for {what}: x, targets, _ = data.sft.collate(batch); targets of shape "
                          f"(B, T) = {tuple(y.shape)}" + (f" = {y.tolist()}" if y.numel() <= 64 else ""), dict(targets=y),
                          "smallest_t_out", SUFFIX, output="your t_out", expected=lambda targets, t_out=t_out: t_out))
    for attn in ("orthros", "swa", "transformer"):
        found += [Case(f"tokens_through_layers({attn!r}, T={T}, t_out={t_out}): {regime}", dict(attn=attn, T=T, t_out=t_out),
                       "tokens_through_layers", ROWS, output="your count",
                       expected=lambda attn, T, t_out, regime=regime: rows_per_layer(attn, regime, T, t_out))
                  for regime, T, t_out in REGIMES]
    return found


def rows_per_layer(attn, regime, T, t_out):
    """Run the regime on a tiny model, and count the rows its first block receives."""
    model, rows = tiny_model(attn, n_layer=1, max_seq_len=max(512, T)), []
    with torch.no_grad():
        cache = model.prefill(tokens(1, 7))[1] if regime == "decode" else None   # then T = 1 new token over the cache
        model.blocks[0].register_forward_pre_hook(lambda block, args: rows.append(args[0].size(1)))
        model(tokens(1, T), t_out=1 if regime == "prefill" else t_out, cache=cache)
    return rows[0]
