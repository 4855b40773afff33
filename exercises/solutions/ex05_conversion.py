"""Exercise 5, the stored solution: a Transformer converted into Orthros by a weight copy."""

import dataclasses

import torch

from orthros import Orthros


def convert(transformer, window):
    config = dataclasses.replace(transformer.config, attn="orthros", window=window)
    model = Orthros(config).to(transformer.wte.weight.dtype)
    # Every Transformer weight has a twin of the same name and shape; the scale-offsets are the
    # only names the Transformer lacks, and load_state_dict(strict=False) leaves them alone.
    model.load_state_dict(transformer.state_dict(), strict=False)  # copies, never shares
    with torch.no_grad():  # identity: q = 1 * (x W_Q) + 0, in both streams (none in the w/o SO ablation)
        for attn in (block.attn for block in model.blocks if block.attn.scale_offset):
            attn.alpha.fill_(1.0), attn.alpha_out.fill_(1.0)
            attn.beta.zero_(), attn.beta_out.zero_()
    return model.train(transformer.training)
