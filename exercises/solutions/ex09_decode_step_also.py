import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    B = next_idx.shape[0]
    x = model.wte(next_idx.view(B, 1))
    rows = 2 if model.config.attn == 'orthros' else 1
    z = x.expand(B, rows, x.size(-1))
    where = torch.tensor([cache.length] * rows, device=next_idx.device)
    rope = rope_cos_sin(where, model.blocks[0].attn.head_dim, model.config.rope_base, model.lm_head.weight.dtype,
                        model.config.rope_scaling)
    with torch.no_grad():
        for l, block in enumerate(model.blocks):
            z = block(z, 1, rope, cache.layers[l])
        cache.length += 1
        return model.lm_head(model.ln_f(z))[:, -1:], cache
