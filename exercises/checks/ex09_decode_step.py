"""Exercise 9, the KV-cache decode step: the checker. The reference is the model's own decode."""

import copy
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, tokens
from orthros import Orthros, OrthrosConfig

TITLE, DIFFICULTY, MINUTES = "The KV-cache decode step", 4, 40
FUNCTIONS = ("decode_step",)
REFERENCE = SimpleNamespace(decode_step=lambda model, next_idx, cache: model.decode(next_idx, cache))
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens,
                           *(f"perf.engine:{name}" for name in ("FastDecoder.prefill", "FastDecoder.decode",
                                                                "FastDecoder.generate_tokens", "layer_in", "layer_out"))),
                          "it runs the forward pass (or the whole decode step) this exercise asks you to build from the "
                          "blocks")
PAPER = "the paper's widths"

HINTS = [
    "Decoding is the same forward pass with T = 1 and t_out = 1: one base token and (for Orthros) one output token, "
    "both at the new position S = cache.length. Each block gets its layer's cache: the block appends the base token's "
    "key and value to it, so the next step sees this token. Then advance cache.length and read the logits from the "
    "output twin.",
    "Shapes, step by step (S = cache.length before the step, C = n_embd, D = C / n_head):\n"
    "1. next_idx (B,) or (B, 1) -> embeddings (B, 1, C)\n"
    "2. z: Orthros, the base twin then the output twin, (B, 2, C); the baselines, the base token alone, (B, 1, C)\n"
    "3. RoPE tables for z's rows, every row at position S: (rows, D) each, in the weights' dtype\n"
    "4. for each layer l: z -> block(z, T=1, rope, that layer's LayerCache) -> z; afterwards cache.layers[l].k is (B, "
    "H, S + 1, D)\n"
    "5. cache.length becomes S + 1; the logits: the final norm and the LM head on z's last row, (B, 1, vocab)\n"
    "6. return (logits, cache)",
    "Paper, section 3.2, Decoding (T_in = 0, T_out = 1): 'each step processes exactly one generated token (T = 1). "
    "This single token is duplicated to form the decoupled pair: the base token updates the KV cache and computes "
    "sliding window attention, while the output-specific token performs full cross-attention against the historical "
    "cache'. In orthros.py: Orthros.forward with a cache, and Orthros.decode.",
]
MODELS = {**{f"attn='orthros', {name}": (name, "orthros") for name in ZOO}, "attn='swa'": ("the original", "swa"),
          "attn='transformer'": ("the original", "transformer")}
WIDE = "the paper's widths: 2 layers of C=768, 6 heads, vocab_size=50304, w=128 (on meta only)"


def inputs(seed, model, B, p, column, place, dtype, **_):
    """The model after prefill(idx[:, :p]): its cache, and the next token idx[:, p] as (B,) or (B, 1)."""
    if model == WIDE:
        with torch.device("meta"):
            model = Orthros(OrthrosConfig(n_layer=2, n_embd=768, n_head=6, vocab_size=50304, window=128)).eval()
    else:
        model = copy.deepcopy(member(*MODELS[model], seed=seed))
    model, idx = model.to(place, dtype), tokens(B, p + 1, model.config.vocab_size, seed).to(place)
    return dict(model=model, next_idx=idx[:, p:] if column else idx[:, p], cache=model.prefill(idx[:, :p])[1])


DOMAIN = {"decode_step": Domain(inputs, pairs=[("model", "dtype"), ("p", "dtype"), ("B", "column")], draws=5,
                                place=["cpu"] * 3 + ["meta"], model=lambda place: [*MODELS, *[WIDE][:place == "meta"]],
                                B=[1, 2, 3], p=[1, 2, 3, 4, 5, 12, 257], column=[False, True],
                                dtype=[torch.float64, torch.float32, torch.bfloat16])}
