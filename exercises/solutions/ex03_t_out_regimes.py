"""Exercise 3, the stored solution: the smallest t_out of an SFT batch, and the tokens per layer."""

from orthros import IGNORE


def smallest_t_out(targets):
    T = targets.size(1)
    columns = (targets != IGNORE).any(dim=0).nonzero()  # the columns that hold a target
    return T - int(columns[0]) if len(columns) else 1


def tokens_through_layers(attn, T, t_out):
    return T + t_out if attn == "orthros" else T  # Orthros: T base tokens + t_out output tokens
