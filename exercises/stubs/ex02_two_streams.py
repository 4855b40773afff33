"""Exercise 2: two streams to logits (Algorithm 2). Build it from a model's own modules.

An Orthros model runs one forward pass over T base tokens plus t_out output tokens. Write it from
a model's modules (calling the model, its forward, prefill, decode or generate is refused):

    model.wte            the token embedding, (vocab, C)
    model.blocks         block(z, T, rope) -> z: z is (B, T + t_out, C), the T base tokens, then
                         the t_out output tokens; rope = (cos, sin) at the positions of z's rows
    rope_cos_sin(positions, head_dim, base, dtype, scaling) -> (cos, sin)   (from orthros: C /
                         n_head, the config's rope_base, the weights' dtype, config.rope_scaling)
    model.ln_f, model.lm_head    the final norm and the LM head

The checker compares yours with model(idx, t_out=t_out) on models with every option orthros.py
has, in float64, float32 and bfloat16: take every size from the model. Eval mode: no dropout.
"""

import torch

from orthros import rope_cos_sin


def two_stream_logits(model, idx, t_out):
    """The logits (B, t_out, vocab) of an Orthros model for idx: (B, T) at its last t_out positions
    (1 <= t_out <= T), as Algorithm 2 computes them."""
    raise NotImplementedError
