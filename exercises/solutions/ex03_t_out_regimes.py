"""Exercise 3, the stored solution: the smallest t_out of an SFT batch, and the tokens per layer."""

from orthros import IGNORE


def smallest_t_out(targets):
    """targets: (B, T) long tensor, -1 = ignored. Returns the smallest t_out (a Python int) such
    that every target that is not -1 lies in the last t_out columns; 1 when nothing is trained."""
    T = targets.size(1)
    columns = (targets != IGNORE).any(dim=0).nonzero()  # the columns that hold a target
    return T - int(columns[0]) if len(columns) else 1


def tokens_through_layers(attn, T, t_out):
    """The number of tokens (rows) that each layer processes in a forward pass over T positions
    whose last t_out are output positions, for attn in ("orthros", "swa", "transformer")."""
    return T + t_out if attn == "orthros" else T  # Orthros: T base tokens + t_out output tokens
