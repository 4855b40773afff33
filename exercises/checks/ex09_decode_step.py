"""Exercise 9, the KV-cache decode step: the checker. The reference: the model's own decode."""

from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, tokens
from orthros import Orthros, OrthrosConfig

TITLE, DIFFICULTY, MINUTES = "The KV-cache decode step", 4, 40
FUNCTIONS = ("decode_step",)
REFERENCE = SimpleNamespace(
    decode_step=lambda model, next_idx, cache: model.decode(next_idx, cache))
ENGINE = ("FastDecoder.prefill", "FastDecoder.decode", "FastDecoder.generate_tokens", "layer_in",
          "layer_out")
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate,
                           Orthros.generate_tokens, *(f"perf.engine:{name}" for name in ENGINE)),
                          "it runs the forward pass (or the decode step) you build from the blocks")
PAPER, BF16 = "the paper's widths", torch.bfloat16
MODELS = {**{f"attn='orthros', {name}": (name, "orthros") for name in ZOO},
          **{f"attn={attn!r}": ("the original", attn) for attn in ("swa", "transformer")}}
WIDE = "the paper's widths: 2 layers of C=768, 6 heads, vocab_size=50304, w=128 (on meta)"


def inputs(seed, model, B, p, column, place, dtype, **_):
    """The model after prefill(idx[:, :p]): its cache; the next token idx[:, p], (B,) or (B, 1)."""
    if model == WIDE:
        with torch.device("meta"):
            model = Orthros(OrthrosConfig(n_layer=2, vocab_size=50304)).eval()
    else:
        model = member(*MODELS[model], seed=seed)
    model, idx = model.to(place, dtype), tokens(B, p + 1, model.config.vocab_size, seed).to(place)
    return dict(model=model, next_idx=idx[:, p:] if column else idx[:, p],
                cache=model.prefill(idx[:, :p])[1])


DOMAIN = {"decode_step": Domain(
    inputs, pairs=[("B", "column")], draws=3, place=["cpu"] * 5 + ["meta"],
    model=lambda place: [*MODELS, *[WIDE][:place == "meta"]], B=[1, 2, 3], column=[False, True],
    dtype=[torch.float64, torch.float32, torch.bfloat16],
    p=lambda place, dtype: [1, 2, 3, 4, 5, 12, *[257][:dtype == BF16 and place == "cpu"]])}
