import torch


def positions_that_change(model, idx, t):
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = lambda tokens: model(tokens)[0][0, t]
        before = logits(idx)
        found = []
        for j in range(t + 1):                      # nothing after t can matter
            other = idx.clone()
            other[0, j] = (other[0, j] + vocab // 2) % vocab
            if (logits(other) != before).any():
                found.append(j)
    return found


def swa_reach(n_layer, window):
    return (window - 1) * n_layer
