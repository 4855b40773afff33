"""Exercise 2: two streams to logits (Algorithm 2). Build it from a model's own modules.

An Orthros model runs one forward pass over T base tokens plus t_out output tokens. Write that
pass from the modules of a trained (here: random) model, without calling the model itself:

    model.wte            the token embedding, (vocab, C)
    model.blocks         the layers; block(z, T, rope) -> z: z is (B, T + t_out, C), the T base
                         tokens first, then the t_out output tokens; rope = (cos, sin) at the
                         positions of z's rows
    rope_cos_sin(positions, head_dim, base, dtype, scaling) -> (cos, sin)   (from orthros; head_dim =
                         C / n_head, base = model.config.rope_base, dtype = the weights' dtype,
                         scaling = model.config.rope_scaling; positions: integers, 0 ... T-1)
    model.ln_f, model.lm_head    the final norm and the LM head (its own matrix, or wte's)

The checker compares yours with model(idx, t_out=t_out) (logits, their gradients, the model left
as it was) on T from 1 to 300 and every t_out from 1 to T, on models with every option orthros.py
has (an untied head, grouped-query attention, SwiGLU, Llama 3 RoPE scaling, ...), in float64,
float32 and bfloat16: take every size from the model. The model is in eval mode: leave dropout out.
Calling the model itself (model(...), model.forward, prefill, decode, generate) is refused while
your code runs: build the pass.

    python -m exercises start 2       (your own copy: exercises/mine/ex02_two_streams.py)
    python -m exercises check 2       python -m exercises hint 2
"""

import torch

from orthros import rope_cos_sin


def two_stream_logits(model, idx, t_out):
    """The logits (B, t_out, vocab) of an Orthros model (config.attn == "orthros") for the token
    ids idx: (B, T) and its last t_out positions (1 <= t_out <= T), as Algorithm 2 computes them."""
    raise NotImplementedError
