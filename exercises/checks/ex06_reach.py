"""Exercise 6, how far each stream can see: the checker. The references: measured live."""

import functools
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, tiny_model, tokens, within
from exercises.solutions import ex06_reach as solution

TITLE, DIFFICULTY, MINUTES = "How far each stream can see", 3, 30
FUNCTIONS = ("positions_that_change", "swa_reach")
PAPER = "n_layer=12"


@functools.cache
def measured_reach(n_layer, window):
    """A tiny SWA model's reach at t = T - 1: its embeddings' gradients are exactly zero beyond."""
    T = n_layer * (window - 1) + 3   # room for the whole reach and two positions beyond it
    model, kept = tiny_model("swa", n_layer=n_layer, window=window, n_embd=8, n_head=1,
                             max_seq_len=max(512, T)), []
    model.wte.register_forward_hook(lambda module, args, out: kept.append(out))
    grad, = torch.autograd.grad(model(tokens(1, T, seed=T))[0][0, T - 1].sum(), kept)
    return T - 1 - int((grad[0] != 0).any(-1).nonzero().min())


REFERENCE = SimpleNamespace(positions_that_change=solution.positions_that_change,
                            swa_reach=measured_reach)
# The models: (zoo member, attn, overrides, the attention output's scale: far influences faint)
MODELS = {"swa, 1 layer, w=2": ("the original", "swa", dict(n_layer=1, window=2), 1),
          "swa, w=3, vocab_size=11": ("the original", "swa", dict(window=3, vocab_size=11), 1),
          "swa, 2 layers, conv_kernel=3": ("conv_kernel=3", "swa", {}, 1),
          "transformer, 2 layers": ("the original", "transformer", {}, 1),
          **{f"swa, 3 layers, w=2, attention outputs x {faint} (far influences faint)": (
              "the original", "swa", dict(n_layer=3, window=2), faint) for faint in (1e-3, 1e-5)},
          **{f"orthros, 2 layers, w=2, {name}": (name, "orthros", dict(n_layer=2, window=2), 1)
             for name in ZOO}}


def inputs(seed, model, T, t, **_):
    """The model; idx with token 0 at t - 1, vocab_size - 1 at t: a change must change both."""
    name, attn, more, faint = MODELS[model]
    model = member(name, attn, seed, **more)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.mul_(faint)
    idx = tokens(1, T, model.config.vocab_size, seed)
    idx[0, max(t - 1, 0)], idx[0, t] = 0, model.config.vocab_size - 1
    return dict(model=model, idx=idx, t=t)


faint = lambda model: "faint" in model   # then the far influences, in float64: the last positions
DOMAIN = {"positions_that_change": Domain(
    inputs, draws=3, model=list(MODELS), T=lambda model: [12] if faint(model) else [1, 2, 5, 8, 12],
    t=lambda model, T: [T - 1] if faint(model) else within(0, T - 1, 0, 1, T - 2, T - 1),
    dtype=lambda model: [torch.float64] + [torch.float32] * (not faint(model))),
    "swa_reach": Domain(draws=5, window=[1, 2, 3, 4, 8, 128],
                        n_layer=lambda window: [12] if window == 128 else [1, 2, 3, 4, 12])}
