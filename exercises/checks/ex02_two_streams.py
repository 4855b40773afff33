"""Exercise 2, two streams to logits (Alg. 2): the checker, hints and known bugs."""

import inspect
from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, tiny_model, tokens
from exercises.solutions import ex02_two_streams as solution
from orthros import Orthros, rope_cos_sin

TITLE = "Two streams to logits (Alg. 2)"
DIFFICULTY = 2
MINUTES = 30
TEACHES = "Alg. 2: duplicate the last t_out embeddings at their twins' positions; the LM head reads only the output stream"
FUNCTIONS = ("two_stream_logits",)
REFERENCE = SimpleNamespace(two_stream_logits=solution.two_stream_logits)
RETURNS = {"two_stream_logits": "logits"}
WHOLE_PASS = "it runs the whole forward pass this exercise asks you to write from the model's modules"
FORBIDDEN = {Orthros.forward: WHOLE_PASS, inspect.unwrap(Orthros.prefill): WHOLE_PASS,
             inspect.unwrap(Orthros.decode): WHOLE_PASS, inspect.unwrap(Orthros.generate): WHOLE_PASS,
             inspect.unwrap(Orthros.generate_tokens): WHOLE_PASS}

HINTS = [
    "The sequence that flows through the layers is the T base tokens followed by copies of the last "
    "t_out embeddings (the output tokens). RoPE needs a position for each row: an output token sits "
    "at the same position as its base twin. After the last layer, keep only the output tokens.",
    "Shapes, step by step (C = n_embd, D = C / n_head):\n"
    "1. embed idx: (B, T) -> (B, T, C)\n"
    "2. z = the T base rows, then a copy of the last t_out of them: (B, T + t_out, C)\n"
    "3. one position per row of z: 0 ... T-1 for the base rows, T-t_out ... T-1 again for the output rows; "
    "the RoPE tables of those positions: (T + t_out, D) each, in the weights' dtype\n"
    "4. every block maps z to z; it needs to know that the first T rows are the base tokens\n"
    "5. the final norm and the LM head on the last t_out rows only: (B, t_out, vocab)",
    "Paper, Algorithm 2: line 2, Z <- Concat[X, X_{T-T_out:, :}] (duplicate the T_out output-specific "
    "tokens); lines 3-8, the L layers; line 9, Z <- Z_{T:, :} (extract the output-specific tokens); "
    "line 10, Norm. In orthros.py: Orthros.forward, the marks '# Alg. 2, line N'.",
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
            z = block(z, T, rope)
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


# -- Further wrong answers the checker must reject ---------------------------------------------

def student_file(body):
    """A whole student file: two_stream_logits with this body (the solution's steps, one changed)."""
    return ("import torch\nimport torch.nn.functional as F\n\nfrom orthros import rope_cos_sin\n\n\n"
            "def two_stream_logits(model, idx, t_out):\n" + "".join(f"    {line}\n" for line in body.splitlines()))


def solution_body(rope="rope_cos_sin(positions, head_dim, model.config.rope_base, model.wte.weight.dtype)",
                  head_dim="model.config.n_embd // model.config.n_head", x="model.wte(idx)", before="", after=""):
    return (f"T = idx.size(1)\nx = {x}\nz = torch.cat([x, x[:, T - t_out:]], dim=1)\n"
            "positions = torch.arange(T)\npositions = torch.cat([positions, positions[T - t_out:]])\n"
            f"head_dim = {head_dim}\n{before}rope = {rope}\nfor block in model.blocks:\n    z = block(z, T, rope)\n"
            f"logits = model.lm_head(model.ln_f(z[:, T:]))\n{after}return logits")


MUTANTS = [
    Mutant("the model called", SimpleNamespace(two_stream_logits=lambda model, idx, t_out: model(idx, t_out=t_out)[0]),
           expect="your code called orthros.Orthros.forward"),
    Mutant("the stored solution imported",
           source="from exercises.solutions.ex02_two_streams import two_stream_logits\n",
           expect="is not available to your code"),
    Mutant("Orthros.forward kept from import time, out of sight",
           source="from orthros import Orthros\n_kept = {'forward': Orthros.forward}\n\n\n"
                  "def two_stream_logits(model, idx, t_out):\n    return _kept['forward'](model, idx, t_out=t_out)[0]\n",
           expect="your code called orthros.Orthros.forward"),
    Mutant("the checker's expected logits imported",
           source="from exercises.checks.ex02_two_streams import model_logits as two_stream_logits\n",
           expect="is not available to your code"),
    Mutant("RoPE's base written in", source=student_file(solution_body(
        rope="rope_cos_sin(positions, head_dim, 10000.0, model.wte.weight.dtype)")), expect="rope_base=500.0"),
    Mutant("head_dim from n_layer", source=student_file(solution_body(
        head_dim="model.config.n_embd // model.config.n_layer")), expect="n_layer=3, n_head=4"),
    Mutant("the RoPE tables in float64 whatever the model", source=student_file(solution_body(
        rope="rope_cos_sin(positions, head_dim, model.config.rope_base, torch.float64)")),
        expect="in float32"),
    Mutant("the logits made float64", source=student_file(solution_body(after="logits = logits.double()\n")),
           expect="your logits have dtype torch.float64, expected torch.float32"),
    Mutant("dropout by F.dropout (training=True by default)", source=student_file(solution_body(
        x="F.dropout(model.wte(idx), model.config.dropout)")), expect="dropout=0.1, in eval mode"),
    Mutant("the RoPE tables kept on the model", source=student_file(solution_body(
        before="model.rope_tables = rope_cos_sin(positions, head_dim, model.config.rope_base, model.wte.weight.dtype)\n",
        rope="model.rope_tables")), expect="changed its input `model`: `model.rope_tables` is new"),
]

EXACT = "in float64, to 1e-12"
INVARIANT = ("the logits equal model(idx, t_out=t_out): the output tokens are copies of the last t_out embeddings at "
             "their twins' positions, and the LM head reads only them")


def logits_case(model, about, B, T, t_out, invariant=INVARIANT, dtype=None, atol=1e-12, seed=None):
    return Case(
        f"two_stream_logits(model, idx, t_out={t_out}), idx of shape ({B}, {T}); model: {about}",
        inputs=lambda: dict(model=model, idx=tokens(B, T, vocab=model.config.vocab_size, seed=T if seed is None else seed),
                            t_out=t_out),
        call=logits, invariant=invariant, atol=atol, expected=model_logits, dtype=dtype)


def cases(**options):
    model = tiny_model("orthros", window=4)
    about = "Orthros, 2 layers, 2 heads, C=16, w=4, random scale-offsets"
    found = []
    for T in (1, 2, 3, 5, 9, 20):
        for t_out in sorted({1, 2, T // 2, T} & set(range(1, T + 1))):
            found.append(logits_case(model, about, 2, T, t_out, f"{INVARIANT}; {EXACT}"))
    # One dimension at a time, each named in the case: what an answer could have written in
    for B in (1, 3):
        found.append(logits_case(model, f"{about} (a batch of {B})", B, 9, 4, f"{INVARIANT}, for every sequence of the batch"))
    found.append(logits_case(tiny_model("orthros", seed=1, window=4), about + ", other weights (seed 1)", 2, 9, 4,
                             f"{INVARIANT}; {EXACT}", seed=1))
    found.append(logits_case(tiny_model("orthros", window=4, rope_base=500.0), about + ", rope_base=500.0 (the default "
                             "is 10000.0)", 2, 9, 4, f"{INVARIANT}; RoPE turns by the model's rope_base, "
                             "model.config.rope_base"))
    found.append(logits_case(tiny_model("orthros", window=3, n_layer=3, n_head=4, n_embd=48), "Orthros, n_layer=3, "
                             "n_head=4, C=48 (head_dim = C / n_head = 12), w=3", 2, 10, 4,
                             f"{INVARIANT}; the RoPE tables have head_dim = n_embd / n_head columns"))
    found.append(logits_case(model, about + ", in float32 (the weights' dtype)", 2, 9, 4,
                             f"{INVARIANT}; the logits in the model's dtype, float32 here, every step in it",
                             dtype=torch.float32, atol=1e-5))
    found.append(logits_case(tiny_model("orthros", window=4, dropout=0.1), about + ", dropout=0.1, in eval mode", 2, 9, 4,
                             f"{INVARIANT}; a model in eval mode drops nothing (F.dropout drops unless told "
                             "training=False)"))
    found.append(logits_case(tiny_model("orthros", window=4, conv_kernel=3), about + ", conv_kernel=3", 2, 9, 4,
                             f"{INVARIANT}; the blocks convolve the base tokens themselves"))
    # The paper's sizes: w = 128, T = 300 (pre-training and prefill)
    wide = tiny_model("orthros", window=128)
    for t_out in (1, 300):
        found.append(logits_case(wide, "Orthros, 2 layers, 2 heads, C=16, w=128 (the paper's window), random "
                                 "scale-offsets", 2, 300, t_out, f"{INVARIANT}; {EXACT}"))
    return found


def logits(answer, model, idx, t_out):
    with torch.no_grad():
        return answer.two_stream_logits(model, idx, t_out)


def model_logits(model, idx, t_out):
    with torch.no_grad():
        return model(idx, t_out=t_out)[0]
