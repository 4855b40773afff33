import torch

from orthros import rope_cos_sin


def two_stream_logits(model, idx, t_out):
    B, T = idx.shape
    x = model.drop(model.wte(idx))
    z = torch.cat([x, x[:, -t_out:]], dim=1)
    positions = torch.arange(T, device=idx.device)
    positions = torch.cat([positions, positions[-t_out:]])
    cos, sin = rope_cos_sin(positions, model.blocks[0].attn.head_dim, model.config.rope_base, scaling=model.config.rope_scaling)
    rope = cos.to(model.lm_head.weight.dtype), sin.to(model.lm_head.weight.dtype)
    for block in model.blocks:
        z = block(z, T, rope)
    return model.lm_head(model.ln_f(z))[:, T:]
