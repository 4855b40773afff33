"""Exercise 6, the stored solution: the reach of each stream, measured."""

import torch


def positions_that_change(model, idx, t):
    with torch.no_grad():
        before = model(idx)[0][:, t]
        changed = []
        for j in range(idx.size(1)):
            other = idx.clone()
            other[0, j] = (other[0, j] + 1) % model.config.vocab_size
            if not torch.equal(model(other)[0][:, t], before):  # exact: a faint influence is an influence
                changed.append(j)
    return changed


def swa_reach(n_layer, window):
    return n_layer * (window - 1)  # each layer reaches w - 1 positions further back
