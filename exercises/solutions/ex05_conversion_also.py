import dataclasses

import torch

from orthros import Orthros


def convert(transformer, window):
    model = Orthros(dataclasses.replace(transformer.config, attn='orthros', window=window))
    model = model.to(dtype=next(transformer.parameters()).dtype)
    own = model.state_dict()
    with torch.no_grad():
        for name, weight in transformer.state_dict().items():
            own[name].copy_(weight)
        for name, p in model.named_parameters():
            if name.endswith(('alpha', 'alpha_out')):
                p.fill_(1.0)
            elif name.endswith(('beta', 'beta_out')):
                p.zero_()
    return model.eval() if not transformer.training else model
