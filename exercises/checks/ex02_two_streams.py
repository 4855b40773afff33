"""Exercise 2, two streams to logits (Alg. 2): the checker. The reference is the model's own forward."""

import copy
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Domain, member, tokens
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Two streams to logits (Alg. 2)", 2, 30
FUNCTIONS = ("two_stream_logits",)
REFERENCE = SimpleNamespace(two_stream_logits=lambda model, idx, t_out: model(idx, t_out=t_out)[0])
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens),
                          "it runs the whole forward pass this exercise asks you to write from the model's modules")
PAPER = "T=300"

HINTS = [
    "The sequence that flows through the layers is the T base tokens followed by copies of the last t_out embeddings "
    "(the output tokens). RoPE needs a position for each row: an output token sits at the same position as its base "
    "twin. After the last layer, keep only the output tokens.",
    "Shapes, step by step (C = n_embd, D = C / n_head):\n"
    "1. embed idx: (B, T) -> (B, T, C)\n"
    "2. z = the T base rows, then a copy of the last t_out of them: (B, T + t_out, C)\n"
    "3. one position per row of z: 0 ... T-1 for the base rows, T-t_out ... T-1 again for the output rows; the RoPE "
    "tables of those positions: (T + t_out, D) each, in the weights' dtype\n"
    "4. every block maps z to z; it needs to know that the first T rows are the base tokens\n"
    "5. the final norm and the LM head on the last t_out rows only: (B, t_out, vocab)",
    "Paper, Algorithm 2: line 2, Z <- Concat[X, X_{T-T_out:, :}] (duplicate the T_out output-specific tokens); lines "
    "3-8, the L layers; line 9, Z <- Z_{T:, :} (extract the output-specific tokens); line 10, Norm. In orthros.py: "
    "Orthros.forward, the marks '# Alg. 2, line N'.",
]


def inputs(seed, model, B, T, **_):
    model = copy.deepcopy(member(model, seed=seed))
    return dict(model=model, idx=tokens(B, T, model.config.vocab_size, seed))


DOMAIN = {"two_stream_logits": Domain(inputs, pairs=[("T", "dtype"), ("model", "dtype"), ("T", "t_out")], draws=5,
                                      model=list(ZOO), B=[1, 2, 3], T=[1, 2, 3, 5, 9, 20, 300],
                                      t_out=lambda T: sorted({1, 2, T - 1, T} - {0, T + 1}),
                                      dtype=[torch.float64, torch.float32, torch.bfloat16])}
