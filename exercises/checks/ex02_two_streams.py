"""Exercise 2, two streams to logits (Alg. 2): the checker, hints and known bugs."""

from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, forbidden, tiny_model, tokens
from exercises.solutions import ex02_two_streams as solution
from orthros import Orthros, rope_cos_sin

TITLE = "Two streams to logits (Alg. 2)"
DIFFICULTY = 2
MINUTES = 30
TEACHES = "Alg. 2: duplicate the last t_out embeddings at their twins' positions; the LM head reads only the output stream"
FUNCTIONS = ("two_stream_logits",)
REFERENCE = SimpleNamespace(two_stream_logits=solution.two_stream_logits)

HINTS = [
    "The sequence that flows through the layers is the T base tokens followed by copies of the last "
    "t_out embeddings (the output tokens). RoPE needs a position for each row: an output token sits "
    "at the same position as its base twin. After the last layer, keep only the output tokens.",
    "x = model.wte(idx)  (B, T, C);  z = cat([x, x[:, T - t_out:]], dim=1)  (B, T + t_out, C)\n"
    "positions = cat([arange(T), arange(T)[T - t_out:]]);  rope = rope_cos_sin(positions, C // n_head, "
    "model.config.rope_base, model.wte.weight.dtype)\n"
    "for block in model.blocks: z, _ = block(z, T, rope)       (n_base = T)\n"
    "logits = model.lm_head(model.ln_f(z[:, T:]))",
    "Paper, Algorithm 2: line 2, Z <- Concat[X, X_{T-T_out:, :}] (duplicate the T_out output-specific "
    "tokens); lines 3-8, the L layers; line 9, Z <- Z_{T:, :} (extract the output-specific tokens); "
    "line 10, Norm. In orthros.py: Orthros._forward, the marks '# Alg. 2, line N'.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(first=False, positions_after=False, base_stream=False):
    def two_stream_logits(model, idx, t_out):
        T = idx.size(1)
        x = model.wte(idx)
        z = torch.cat([x, x[:, :t_out] if first else x[:, T - t_out:]], dim=1)
        positions = torch.arange(T + t_out) if positions_after else \
            torch.cat([torch.arange(T), torch.arange(T)[T - t_out:]])
        rope = rope_cos_sin(positions, model.config.n_embd // model.config.n_head, model.config.rope_base,
                            model.wte.weight.dtype)
        for block in model.blocks:
            z, _ = block(z, T, rope)
        return model.lm_head(model.ln_f(z[:, T - t_out:T] if base_stream else z[:, T:]))
    return SimpleNamespace(two_stream_logits=two_stream_logits)


BUGS = [
    Bug("the first t_out duplicated", "x[:, :t_out] copies the first embeddings, not the last: the output "
        "tokens must be the twins of the positions whose next token is predicted.", make_bug(first=True)),
    Bug("output tokens at new positions", "the output tokens got positions T ... T+t_out-1; RoPE must place "
        "each at its base twin's position T-t_out ... T-1.", make_bug(positions_after=True)),
    Bug("the LM head on the base stream", "the logits were read from the base tokens at the output positions; "
        "Alg. 2, line 9 keeps the output tokens, the last t_out rows of z.", make_bug(base_stream=True)),
]


def cases(**options):
    model = tiny_model("orthros", window=4)
    found = []
    for T in (1, 2, 3, 5, 9, 20):
        idx = tokens(2, T, seed=T)
        for t_out in sorted({1, 2, T // 2, T} & set(range(1, T + 1))):
            found.append(Case(
                f"two_stream_logits(model, idx, t_out={t_out}), idx of shape (2, {T}); model: Orthros, "
                "2 layers, C=16, w=4, random scale-offsets",
                lambda impl, idx=idx, t_out=t_out: logits(impl, model, idx, t_out),
                "the logits equal model(idx, t_out=t_out): the output tokens are copies of the last t_out "
                "embeddings at their twins' positions, and the LM head reads only them",
                atol=1e-12, expected=lambda idx=idx, t_out=t_out: model(idx, t_out=t_out)[0]))
    return found


def logits(impl, model, idx, t_out):
    with torch.no_grad(), forbidden(Orthros, "forward", "_forward",
                                    why="this exercise asks you to write: use its modules"):
        return impl.two_stream_logits(model, idx, t_out)
