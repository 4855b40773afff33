"""Exercise 2, the stored solution: Algorithm 2 from a model's modules."""

import torch

from orthros import rope_cos_sin


def two_stream_logits(model, idx, t_out):
    T = idx.size(1)
    x = model.wte(idx)                                       # (B, T, C)
    z = torch.cat([x, x[:, T - t_out:]], dim=1)              # Alg. 2, line 2: (B, T + t_out, C)
    positions = torch.arange(T)
    positions = torch.cat([positions, positions[T - t_out:]])  # an output token sits at its twin's position
    head_dim = model.config.n_embd // model.config.n_head
    rope = rope_cos_sin(positions, head_dim, model.config.rope_base, model.wte.weight.dtype, model.config.rope_scaling)
    for block in model.blocks:                               # Alg. 2, lines 3-8
        z = block(z, T, rope)
    return model.lm_head(model.ln_f(z[:, T:]))               # lines 9-10: the output tokens only
