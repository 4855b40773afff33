import torch


def smallest_t_out(targets):
    rows, columns = torch.where(targets >= 0)
    return targets.shape[-1] - columns.min().item() if len(columns) else 1


def tokens_through_layers(attn, T, t_out):
    return {'orthros': T + t_out}.get(attn, T)
