"""Exercise 9, the stored solution: one decode step through the KV cache."""

import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    """Append next_idx: (B,) or (B, 1), one token per sequence, to cache (a KVCache from
    model.prefill). Returns (logits, cache): logits (B, 1, vocab) predict the token after next_idx."""
    x = model.wte(next_idx.reshape(-1, 1))                    # (B, 1, C): the new token's embedding
    orthros = model.config.attn == "orthros"
    z = torch.cat([x, x], dim=1) if orthros else x            # its base twin, then its output twin
    position = torch.tensor([cache.length] * z.size(1))       # both twins sit at the new position S
    rope = rope_cos_sin(position, model.config.n_embd // model.config.n_head, model.config.rope_base,
                        model.wte.weight.dtype)
    with torch.no_grad():
        for l, block in enumerate(model.blocks):
            z, present = block(z, 1, rope, (cache.k[l], cache.v[l], cache.conv[l]))
            cache.k[l], cache.v[l], cache.conv[l] = present     # the cache keeps every position: S + 1
        cache.length += 1
        return model.lm_head(model.ln_f(z[:, -1:])), cache   # the output twin (the only token for the baselines)
