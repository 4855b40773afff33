"""Exercise 5: converting a Transformer into Orthros (the paper's section 4.3).

Orthros adds no weight matrix to a Transformer: the only new parameters are the four scale-offsets
per layer (alpha, beta, alpha', beta'). So a trained Transformer becomes an Orthros model by a
weight copy, with the scale-offsets at identity (q = 1 * (x W_Q) + 0); with a window w >= T it
then gives exactly the Transformer's logits.

Write convert(transformer, window): a new Orthros model (config.attn = "orthros", this window, the
rest as in the Transformer's config) holding copies of its weights, every parameter trainable,
the Transformer left as it was (Orthros.load_transformer_weights is refused). The checker compares
it with orthros.py's own conversion, and its logits with the Transformer's, on Transformers with
every option orthros.py has, bfloat16 and scale_offset=False (the paper's "w/o SO": none) too.
"""

import dataclasses

import torch

from orthros import Orthros


def convert(transformer, window):
    """A new Orthros model (attn="orthros", this window) with a copy of transformer's weights (an
    Orthros with attn="transformer"), identity scale-offsets, in its dtype and mode (train/eval)."""
    raise NotImplementedError
