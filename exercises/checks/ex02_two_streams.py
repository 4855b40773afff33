"""Exercise 2, two streams to logits (Alg. 2): the checker."""

import torch

from exercises.framework import ZOO, Bug, Case, Mutant, handed_to_blocks, tiny_model, tokens
from exercises.solutions import ex02_two_streams as solution
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Two streams to logits (Alg. 2)", 2, 30
FUNCTIONS = ("two_stream_logits",)
REFERENCE = solution   # the stored solution: its functions
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens),
                          "it runs the whole forward pass this exercise asks you to write from the model's modules")
PAPER = "w=128 (the paper's window)"

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

TWINS = "z = torch.cat([x, x[:, T - t_out:]], dim=1)"
BUGS = [
    Bug("the first t_out duplicated", "x[:, :t_out] copies the first embeddings, not the last: the output tokens must be "
        "the twins of the positions whose next token is predicted.", {TWINS: "z = torch.cat([x, x[:, :t_out]], dim=1)"}),
    Bug("output tokens at new positions", "the output tokens got positions T ... T+t_out-1; RoPE must place each at its "
        "base twin's position T-t_out ... T-1.", {"positions = torch.arange(T)\n": "positions = torch.arange(T + t_out)\n",
                                                   "torch.cat([positions, positions[T - t_out:]])": "positions"}),
    Bug("the LM head on the base stream", "the logits were read from the base tokens at the output positions; Alg. 2, "
        "line 9 keeps the output tokens, the last t_out rows of z.", {"z[:, T:]": "z[:, T - t_out:T]"}),
]
MUTANTS = [
    Mutant("the model called", "your code called orthros.Orthros.forward",
           source="def two_stream_logits(model, idx, t_out):\n    return model(idx, t_out=t_out)[0]\n"),
    Mutant("the stored solution imported", "is not available to your code",
           source="from exercises.solutions.ex02_two_streams import two_stream_logits\n"),
    Mutant("Orthros.forward kept from import time, out of sight", "your code called orthros.Orthros.forward",
           source="from orthros import Orthros\n_kept = {'forward': Orthros.forward}\n\n\n"
                  "def two_stream_logits(model, idx, t_out):\n    return _kept['forward'](model, idx, t_out=t_out)[0]\n"),
    Mutant("RoPE's base written in", "rope_base=500000.0", {"model.config.rope_base,": "10000.0,"}),
    Mutant("head_dim from n_layer", "n_head=4", {"// model.config.n_head": "// model.config.n_layer"}),
    Mutant("head_dim from n_kv_head", "n_kv_head=2 (GQA)", {"// model.config.n_head": "// (model.config.n_kv_head or 2)"}),
    Mutant("the RoPE tables in float64 whatever the model", "in bfloat16", {"model.wte.weight.dtype,": "torch.float64,"}),
    Mutant("the RoPE tables in float32 (rope_cos_sin's default)", "float32, expected torch.float64",
           {"model.wte.weight.dtype, model": "scaling=model"}),
    Mutant("the RoPE scaling left out", "llama3 RoPE scaling", {", model.config.rope_scaling)": ")"}),
    Mutant("the LM head read as the embedding (a tied model's)", "untied head",
           {"model.lm_head(model.ln_f(z[:, T:]))": "model.ln_f(z[:, T:]) @ model.wte.weight.T"}),
    Mutant("positions made in the weights' dtype", "past 256", {"torch.arange(T)\n": "torch.arange(T, dtype=model.wte.weight.dtype)\n"}),
    Mutant("the logits made float64", "your logits have dtype torch.float64, expected torch.bfloat16",
           {"model.ln_f(z[:, T:]))": "model.ln_f(z[:, T:])).double()"}),
    Mutant("the embeddings made float32 and back", "about float32's rounding",
           {"x = model.wte(idx)": "x = model.wte(idx).float().to(model.wte.weight.dtype)   # float32 holds an embedding"}),
    Mutant("dropout by F.dropout (training=True by default)", "dropout=0.1, in eval mode",
           {"x = model.wte(idx)": "x = torch.nn.functional.dropout(model.wte(idx), model.config.dropout)"}),
    Mutant("the RoPE tables kept on the model", "changed its input `model`: `model.rope_tables` is new",
           {"rope = rope_cos_sin(": "rope = model.rope_tables = rope_cos_sin("}),
    Mutant("the output twins not handed to the blocks as output tokens", "your code hands block 0 T=",
           {"z = block(z, T, rope)": "z = block(z, z.size(1), rope)"}),
]
INVARIANT = ("the logits equal model(idx, t_out=t_out): the output tokens are copies of the last t_out embeddings at "
             "their twins' positions, and the LM head reads only them")
ABOUT = "Orthros, 2 layers, 2 heads, C=16, w=4, random scale-offsets"


def logits_case(model, B, T, t_out, about=ABOUT, invariant=INVARIANT, dtype=None, seed=None):
    return Case(f"two_stream_logits(model, idx, t_out={t_out}), idx of shape ({B}, {T}); model: {about}",
                dict(model=model, idx=tokens(B, T, vocab=model.config.vocab_size, seed=seed or T), t_out=t_out), logits,
                invariant, dtype=dtype, output="your logits", expected=lambda model, idx, t_out: model(idx, t_out=t_out)[0])


def cases(**options):
    model = tiny_model("orthros", window=4)
    for T, t_out in [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (5, 2), (9, 4), (20, 10), (20, 20)]:
        yield logits_case(model, 2, T, t_out)
    # One dimension at a time, each named in the case: what an answer could have written in
    for B in (1, 3):
        yield logits_case(model, B, 9, 4, f"{ABOUT} (a batch of {B})", f"{INVARIANT}, for every sequence of the batch")
    yield logits_case(tiny_model("orthros", seed=1, window=4), 2, 9, 4, f"{ABOUT}, other weights (seed 1)", seed=1)
    yield from [logits_case(tiny_model("orthros", **more), 2, 9, 4, f"{name}, w=4", dtype=dtype) for name, more, dtype in ZOO]
    yield logits_case(tiny_model("orthros", window=4, dropout=0.1), 2, 9, 4, f"{ABOUT}, dropout=0.1, in eval mode",
                      f"{INVARIANT}; a model in eval mode drops nothing (F.dropout drops unless told training=False)")
    yield logits_case(tiny_model("orthros", window=4, conv_kernel=3), 2, 9, 4, f"{ABOUT}, conv_kernel=3",
                      f"{INVARIANT}; the blocks convolve the base tokens themselves")
    wide = tiny_model("orthros", window=128)
    yield from [logits_case(wide, 2, 300, t_out, f"Orthros, 2 layers, 2 heads, C=16, {PAPER}") for t_out in (1, 300)]
    yield logits_case(wide, 1, 300, 2, f"the same, positions past 256 (bfloat16 holds every integer only up to 256)",
                      f"{INVARIANT}; positions are integers, whatever the model's dtype", torch.bfloat16)


def logits(answer, model, idx, t_out):
    B, T = idx.shape
    twins = lambda rows: torch.cat([torch.arange(T), torch.arange(T - t_out, T)])   # an output token at its twin's position
    with torch.no_grad(), handed_to_blocks(model, B, T + t_out, T, "the T base tokens, then the t_out output tokens", twins):
        return answer.two_stream_logits(model, idx, t_out)
