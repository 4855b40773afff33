"""Exercise 5, converting a Transformer: the checker. The reference: orthros.py's own conversion."""

import dataclasses
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, difference, member, tokens
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Converting a Transformer", 3, 30
FUNCTIONS = ("convert",)
FORBIDDEN = {Orthros.load_transformer_weights: "orthros.py's own conversion, which you write"}
PAPER = "window=128"


def convert(transformer, window):
    config = dataclasses.replace(transformer.config, attn="orthros", window=window)
    model = Orthros(config).to(transformer.wte.weight.dtype)
    model.load_transformer_weights(transformer.state_dict())
    return model.train(transformer.training)


REFERENCE = SimpleNamespace(convert=convert)
DOMAIN = {"convert": Domain(
    lambda seed, transformer, mode, **_: dict(
        transformer=member(transformer, "transformer", seed).train(mode == "train")),
    pairs=[("transformer", "dtype"), ("mode", "dtype")], draws=5,
    transformer=list(ZOO), mode=["eval", "train"], window=[1, 2, 4, 24, 128, 512, 513, 10 ** 6],
    dtype=[torch.float64, torch.float32, torch.bfloat16])}


def transformers_logits(answer, **options):
    """with a window >= T, your converted model gives the Transformer's logits"""
    for name in ZOO:
        transformer = member(name, "transformer")
        idx = tokens(2, 24, transformer.config.vocab_size)
        with torch.no_grad():
            mine = answer.convert(transformer, 24).eval()(idx)[0]
            problem = difference(mine, transformer(idx)[0], "the logits")
        if problem:
            return f"convert(transformer, window=24)(idx), idx (2, 24), {name}: {problem}"


PROPERTIES = [transformers_logits]
