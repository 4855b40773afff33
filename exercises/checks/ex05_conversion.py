"""Exercise 5, converting a Transformer: the checker. The reference is orthros.py's own conversion."""

import copy
import dataclasses
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, difference, member, tokens
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Converting a Transformer", 3, 30
FUNCTIONS = ("convert",)


def orthros_conversion(transformer, window):
    model = Orthros(dataclasses.replace(transformer.config, attn="orthros", window=window)).to(transformer.wte.weight.dtype)
    model.load_transformer_weights(transformer.state_dict())
    return model.train(transformer.training)


REFERENCE = SimpleNamespace(convert=orthros_conversion)
FORBIDDEN = {Orthros.load_transformer_weights: "orthros.py's own conversion, which this exercise asks you to write"}
PAPER = "window=128"


def inputs(seed, transformer, mode, **_):
    return dict(transformer=copy.deepcopy(member(transformer, "transformer", seed)).train(mode == "train"))


DOMAIN = {"convert": Domain(inputs, pairs=[("transformer", "dtype"), ("transformer", "window"), ("mode", "dtype")],
                            transformer=list(ZOO), mode=["eval", "train"], window=[1, 2, 4, 24, 128, 512, 513, 10 ** 6],
                            dtype=[torch.float64, torch.float32, torch.bfloat16])}


def transformers_logits(answer, **options):
    """with a window >= T, your converted model gives the Transformer's logits"""
    for name in ZOO:
        transformer, idx = copy.deepcopy(member(name, "transformer")), tokens(2, 24, member(name).config.vocab_size)
        with torch.no_grad():
            problem = difference(answer.convert(transformer, 24).eval()(idx)[0], transformer(idx)[0], "the logits")
        if problem:
            return f"convert(transformer, window=24)(idx) for idx of shape (2, 24), transformer: {name}: {problem}"


PROPERTIES = [transformers_logits]
