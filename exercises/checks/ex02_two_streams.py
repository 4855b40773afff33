"""Exercise 2, two streams to logits (Alg. 2): the checker. The reference: the model's forward."""

from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, tokens, within
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Two streams to logits (Alg. 2)", 2, 30
FUNCTIONS = ("two_stream_logits",)
REFERENCE = SimpleNamespace(two_stream_logits=lambda model, idx, t_out: model(idx, t_out=t_out)[0])
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate,
                           Orthros.generate_tokens), "it runs the whole forward pass this exercise "
                          "asks you to write from the model's modules")
PAPER = "T=300"


def inputs(seed, model, B, T, **_):
    model = member(model, seed=seed)
    return dict(model=model, idx=tokens(B, T, model.config.vocab_size, seed))


DOMAIN = {"two_stream_logits": Domain(
    inputs, pairs=[("T", "dtype"), ("T", "t_out")], draws=3, model=list(ZOO),
    B=[1, 2, 3], T=[1, 2, 3, 5, 9, 20, 300], t_out=lambda T: within(1, T, 1, 2, T - 1, T),
    dtype=[torch.float64, torch.float32, torch.bfloat16])}
