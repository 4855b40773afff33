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

HINTS = [
    "Build a new model from the Transformer's config with two fields changed (attn, window), in the Transformer's "
    "dtype. Copy every weight by name: the names are the same in both models. The four scale-offsets per layer are the"
    " only parameters a Transformer lacks: set them to the identity (alpha = alpha' = 1, beta = beta' = 0).",
    "1. a config: the Transformer's (model.config, a dataclass) with attn and window replaced\n"
    "2. a new Orthros model of that config, in the Transformer's dtype (float64 here: a float32 copy is not exact)\n"
    "3. copy every tensor of the Transformer's state dict into the tensor of the same name (copies, never the same "
    "storage); the new model's scale-offsets are the only names left over\n"
    "4. without gradients, set alpha and alpha' to ones, beta and beta' to zeros, in every layer's attention\n"
    "5. leave the Transformer as it was (its weights and its mode)",
    "Paper, section 4.3 (Conversion Training) and Table 6: 'Orthros Conversion replaces the original full attention "
    "modules with Orthros Attention', with no new weight matrix (Algorithm 1, line 2: W_Q, W_K, W_V, W_O are the "
    "Transformer's). In orthros.py: Orthros.load_transformer_weights.",
]


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
