"""Exercise 5: converting a Transformer into Orthros (the paper's section 4.3).

Orthros adds no weight matrix to a Transformer: every weight keeps its name and shape, and the
only new parameters are the four scale-offsets per layer (alpha, beta, alpha', beta'). So a trained
Transformer becomes an Orthros model by a pure weight copy, with the scale-offsets at identity
(q = 1 * (x W_Q) + 0). With a window w >= T nothing is cut off, and the converted model then
gives exactly the Transformer's logits.

Write convert(transformer, window): a new Orthros model (config.attn = "orthros", the given
window, everything else as in the Transformer's config) holding copies of the Transformer's
weights, every parameter trainable, and leave the Transformer as it was. Don't call
Orthros.load_transformer_weights: the checker refuses it while your code runs. The checker
compares your model (its config, weights, what trains, its mode, each layer's attributes) with
orthros.py's own conversion, for windows up to past max_seq_len, and its logits with the Transformer's, on Transformers with every option orthros.py has: an untied LM head (lm_head is not
wte), grouped-query attention, SwiGLU, Q/K/V biases, trained norms, Llama 3 RoPE scaling, bfloat16,
and scale_offset=False (the paper's "w/o SO" ablation: no scale-offsets at all).

    python -m exercises start 5       (your own copy: exercises/mine/ex05_conversion.py)
    python -m exercises check 5       python -m exercises hint 5
"""

import dataclasses

import torch

from orthros import Orthros


def convert(transformer, window):
    """A new Orthros model (attn="orthros", this window) with a copy of the weights of
    transformer (an Orthros instance with config.attn == "transformer"), its scale-offsets at
    identity, in the Transformer's dtype and mode (train or eval)."""
    raise NotImplementedError
