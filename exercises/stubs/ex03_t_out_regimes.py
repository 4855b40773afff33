"""Exercise 3: the t_out regimes. Pre-training, SFT, prefill and decode are one forward pass.

The paper's section 3.2: the same forward(idx, t_out) serves every regime; only t_out changes.

    regime         T (tokens in idx)        t_out
    pre-training   the sequence             T          every position predicts its next token
    SFT            prompt + response        response + 1 (the last prompt token predicts the first
                                                       response token)
    prefill        the prompt               1          only the last prompt token predicts
    decode         1 (the new token)        1

1. smallest_t_out(targets): orthros.py refuses a target before the last t_out positions, and each
   output position costs a second token in every layer: the smallest t_out covering every target
   (checked against the smallest that orthros.py's check_targets accepts).
2. tokens_through_layers(attn, T, t_out): the rows of z in Orthros.forward, for attn "orthros",
   "swa" or "transformer" (counted live, with a hook on a model's first block).
"""

import torch


def smallest_t_out(targets):
    """targets: (B, T) long tensor, -1 = ignored. Returns the smallest t_out (a Python int) such
    that every target that is not -1 lies in the last t_out columns; 1 when nothing is trained."""
    raise NotImplementedError


def tokens_through_layers(attn, T, t_out):
    """The tokens (rows) each layer processes in a forward pass over T positions whose last t_out
    are output positions."""
    raise NotImplementedError
