"""Exercise 3, the t_out regimes: the checker. The references: measured live, on orthros.py."""

import contextlib
from types import SimpleNamespace

import torch

from data.sft import collate
from exercises.framework import Domain, tiny_model, tokens, within
from orthros import IGNORE, check_targets

TITLE, DIFFICULTY, MINUTES = "The t_out regimes", 2, 30
FUNCTIONS = ("smallest_t_out", "tokens_through_layers")
FORBIDDEN = {collate: "data/sft.py's own t_out of a batch, which the checker compares yours with",
             check_targets: "orthros.py's check of a t_out, which the checker compares yours with"}
PAPER = "T=2048"


def smallest_t_out(targets):
    for t_out in range(1, targets.size(1) + 1):
        with contextlib.suppress(ValueError):   # check_targets raises where a target is left out
            return check_targets(targets, t_out) or t_out


def counted(attn, T, t_out):   # the rows of z a tiny model's first block receives
    model, seen = tiny_model(attn, n_layer=1, max_seq_len=max(512, T)), []
    model.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(args[0].size(1)))
    with torch.no_grad():
        model(tokens(1, T), t_out=t_out)
    return seen[0]


REFERENCE = SimpleNamespace(smallest_t_out=smallest_t_out, tokens_through_layers=counted)


def targets(seed, B, T, first, rows, **_):
    """(B, T) targets: row r trained from column `first` (token 0 there), the rest by `rows`."""
    g = torch.Generator().manual_seed(seed)
    y, r = torch.randint(0, 37, (B, T), generator=g), int(torch.randint(B, (), generator=g))
    start = torch.randint(first, T + 1, (B, 1), generator=g) if rows == "ragged" else \
        torch.full((B, 1), T if rows == "holes" else first)   # holes: row r alone, with gaps
    start[r] = first
    y = torch.where(torch.arange(T) >= start, y, IGNORE)
    if rows == "holes":
        y[r, first + 1:][torch.rand(max(0, T - first - 1), generator=g) < 0.5] = IGNORE
    y[r, first:first + 1] = 0
    return dict(targets=y)


DOMAIN = {"smallest_t_out": Domain(
    targets, pairs=[("T", "first"), ("first", "rows")], B=[1, 2, 3, 6], T=[1, 2, 3, 5, 9, 2048],
    first=lambda T: within(0, T, 0, 1, T // 2, T - 1, T),
    rows=["every row from first", "ragged", "holes"]),
    "tokens_through_layers": Domain(
    pairs=True, attn=["orthros", "swa", "transformer"], T=[1, 2, 3, 12, 2048],
    t_out=lambda T: within(1, T, 1, 2, T - 1, T))}
