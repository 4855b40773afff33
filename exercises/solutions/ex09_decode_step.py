"""Exercise 9, the stored solution: one decode step through the KV cache."""

import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    x = model.wte(next_idx.reshape(-1, 1))                    # (B, 1, C): the new token's embedding
    orthros = model.config.attn == "orthros"
    z = torch.cat([x, x], dim=1) if orthros else x            # its base twin, then its output twin
    S = cache.length                                          # positions 0 ... S-1 are in the cache
    position = torch.full((z.size(1),), S, device=x.device)   # both twins sit at the new position S
    rope = rope_cos_sin(position, model.config.n_embd // model.config.n_head, model.config.rope_base,
                        model.wte.weight.dtype, model.config.rope_scaling)
    with torch.no_grad():
        for block, layer_cache in zip(model.blocks, cache.layers):
            z = block(z, 1, rope, layer_cache)                # T = 1 base token; appends its k, v: S + 1 keys
        cache.length = S + 1
        return model.lm_head(model.ln_f(z[:, -1:])), cache   # the output twin (the only token for the baselines)
