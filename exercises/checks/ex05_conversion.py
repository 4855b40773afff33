"""Exercise 5, converting a Transformer: the checker, hints and known bugs."""

import dataclasses
from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, student_side, tiny_model, tokens, using
from exercises.solutions import ex05_conversion as solution
from orthros import Orthros

TITLE = "Converting a Transformer"
DIFFICULTY = 3
MINUTES = 30
TEACHES = "the conversion is a pure weight copy with identity scale-offsets; with w >= T Orthros is the Transformer"
FUNCTIONS = ("convert",)
REFERENCE = SimpleNamespace(convert=solution.convert)
RETURNS = {"convert": "model"}
FORBIDDEN = {Orthros.load_transformer_weights: "orthros.py's own conversion, which this exercise asks you to write"}

HINTS = [
    "Build a new model from the Transformer's config with two fields changed (attn, window), in the "
    "Transformer's dtype. Copy every weight by name: the names are the same in both models. The four "
    "scale-offsets per layer are the only parameters a Transformer lacks: set them to the identity "
    "(alpha = alpha' = 1, beta = beta' = 0).",
    "1. a config: the Transformer's (model.config, a dataclass) with attn and window replaced\n"
    "2. a new Orthros model of that config, in the Transformer's dtype (float64 here: a float32 copy is not exact)\n"
    "3. copy every tensor of the Transformer's state dict into the tensor of the same name (copies, never "
    "the same storage); the new model's scale-offsets are the only names left over\n"
    "4. without gradients, set alpha and alpha' to ones, beta and beta' to zeros, in every layer's attention\n"
    "5. leave the Transformer as it was (its weights and its mode)",
    "Paper, section 4.3 (Conversion Training) and Table 6: 'Orthros Conversion replaces the original full "
    "attention modules with Orthros Attention', with no new weight matrix (Algorithm 1, line 2: W_Q, W_K, "
    "W_V, W_O are the Transformer's). In orthros.py: Orthros.load_transformer_weights.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(zero=False, swa=False, share=False, reference=False):
    def convert(transformer, window):
        if reference:  # orthros.py's own conversion: refused
            model = Orthros(dataclasses.replace(transformer.config, attn="orthros", window=window))
            model.load_transformer_weights(transformer.state_dict())
            return model.to(transformer.wte.weight.dtype)
        config = dataclasses.replace(transformer.config, attn="swa" if swa else "orthros", window=window)
        model = Orthros(config).to(transformer.wte.weight.dtype)
        if share:  # the Transformer's own Parameter objects, not copies
            for name, p in transformer.named_parameters():
                module, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module), attr, p)
            model.lm_head.weight = model.wte.weight
        else:
            model.load_state_dict(transformer.state_dict(), strict=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.rsplit(".", 1)[-1] in ("alpha", "alpha_out", "beta", "beta_out"):
                    p.fill_(0.0 if zero or "beta" in name else 1.0)
        return model
    return SimpleNamespace(convert=convert)


BUGS = [
    Bug("the scale-offsets at zero", "alpha = 0 multiplies every query by 0 (uniform attention); the identity "
        "is alpha = alpha' = 1, beta = beta' = 0.", make_bug(zero=True)),
    Bug("a sliding-window model, not Orthros", "attn='swa' keeps the window but drops the output stream's full "
        "cross-attention: set attn='orthros'.", make_bug(swa=True)),
    Bug("the Transformer's tensors shared, not copied", "assigning the Transformer's Parameters makes both "
        "models one: training the converted model would change the Transformer too.", make_bug(share=True)),
]


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

def convert_in_place(transformer, window):
    transformer.config = dataclasses.replace(transformer.config, attn="orthros", window=window)
    return right_copy(transformer, window)


right_copy = student_side(make_bug().convert)   # it runs as part of the mutant


MUTANTS = [
    Mutant("orthros.py's conversion called", make_bug(reference=True),
           expect="your code called orthros.Orthros.load_transformer_weights"),
    Mutant("the Transformer's config changed", SimpleNamespace(convert=convert_in_place),
           expect="changed its input `transformer`: `transformer.config.window` was 32, now 4"),
]


def cases(**options):
    transformer = tiny_model("transformer", randomize=False, window=32)
    conv = tiny_model("transformer", randomize=False, window=32, conv_kernel=3, seed=1)
    idx = tokens(2, 24)
    found = [
        Case("dataclasses.asdict(convert(transformer, window=4).config)",
             inputs=lambda: dict(transformer=transformer, window=4),
             call=lambda answer, transformer, window: dataclasses.asdict(converted(answer, transformer, window).config),
             invariant="the Transformer's config with attn='orthros' and the new window; nothing else changes",
             expected=lambda transformer, window: dataclasses.asdict(
                 dataclasses.replace(transformer.config, attn="orthros", window=window)),
             output="your model's config"),
        Case("the converted model's state dict, at the Transformer's names: convert(transformer, window=4)",
             inputs=lambda: dict(transformer=transformer, window=4),
             call=lambda answer, transformer, window: shared_weights(converted(answer, transformer, window), transformer),
             invariant="every Transformer weight is copied exactly, under its own name, in its dtype (a pure "
                       "weight copy)",
             expected=lambda transformer, window: {k: w.clone() for k, w in transformer.state_dict().items()},
             output="your model's state dict"),
        Case("the converted model's scale-offsets (the names the Transformer lacks): convert(transformer, window=4)",
             inputs=lambda: dict(transformer=transformer, window=4),
             call=lambda answer, transformer, window: new_parameters(converted(answer, transformer, window), transformer),
             invariant="the scale-offsets start at the identity, alpha = alpha' = 1, beta = beta' = 0 (as "
                       "orthros.py's load_transformer_weights leaves them)",
             expected=lambda transformer, window: new_parameters(reference_conversion(transformer, window), transformer),
             output="your model's scale-offsets"),
        Case("which of the converted model's tensors share memory with the Transformer's: convert(transformer, window=4)",
             inputs=lambda: dict(transformer=transformer, window=4),
             call=lambda answer, transformer, window: sharing(converted(answer, transformer, window), transformer),
             invariant="the converted model owns copies: training it must leave the Transformer unchanged",
             holds=lambda shared: f"{len(shared)} tensors are the Transformer's own, e.g. {shared[0]}" if shared else None),
    ]
    for model, what in ((transformer, "the Transformer"), (conv, "a Transformer with conv_kernel=3")):
        for t_out in (24, 5):
            found.append(Case(
                f"convert(transformer, window=32)(idx, t_out={t_out})[0], idx of shape (2, 24), {what}",
                inputs=lambda model=model, t_out=t_out: dict(transformer=model, window=32, idx=idx, t_out=t_out),
                call=converted_logits,
                invariant="with w >= T and identity scale-offsets, Orthros gives the Transformer's logits", atol=1e-12,
                expected=lambda transformer, window, idx, t_out: logits(transformer, idx, t_out),
                output="your model's logits"))
    found.append(Case(
        "convert(transformer, window=4)(idx)[0], idx of shape (2, 24)",
        inputs=lambda: dict(transformer=transformer, window=4, idx=idx, t_out=24),
        call=converted_logits,
        invariant="with w < T the converted model computes what orthros.py's own conversion computes", atol=1e-12,
        expected=lambda transformer, window, idx, t_out: logits(reference_conversion(transformer, window), idx, t_out),
        output="your model's logits"))
    return found


def converted(answer, transformer, window):
    model = answer.convert(transformer, window)   # its form (an Orthros) is checked on return
    with using("your model's .eval()"):
        return model.eval()


def converted_logits(answer, transformer, window, idx, t_out):
    model = converted(answer, transformer, window)
    with using(f"your model(idx, t_out={t_out})"):
        return logits(model, idx, t_out)


def logits(model, idx, t_out):
    with torch.no_grad():
        return model(idx, t_out=t_out)[0]


def reference_conversion(transformer, window):
    model = Orthros(dataclasses.replace(transformer.config, attn="orthros", window=window)).double()
    model.load_transformer_weights(transformer.state_dict())
    return model.eval()


def shared_weights(model, transformer):
    own = model.state_dict()
    return {k: own.get(k, "missing") for k in transformer.state_dict()}


def new_parameters(model, transformer):
    return {k: w for k, w in model.state_dict().items() if k not in transformer.state_dict()}


def sharing(model, transformer):
    theirs = {p.untyped_storage().data_ptr() for p in transformer.state_dict().values()}
    return [k for k, w in model.state_dict().items() if w.untyped_storage().data_ptr() in theirs]
