"""Exercise 5, converting a Transformer: the checker, hints and known bugs."""

import dataclasses
from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, Wrong, student_side, tiny_model, tokens, using
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


# -- Further wrong answers the checker must reject ---------------------------------------------

def convert_in_place(transformer, window):
    transformer.config = dataclasses.replace(transformer.config, attn="orthros", window=window)
    return right_copy(transformer, window)


right_copy = student_side(make_bug().convert)   # it runs as part of the mutant


def student_file(body):
    """A whole student file: convert with this body."""
    return ("import copy\nimport dataclasses\n\nimport torch\n\nfrom orthros import Orthros, OrthrosConfig\n\n\n"
            "def convert(transformer, window):\n" + "".join(f"    {line}\n" for line in body.splitlines()))


def solution_body(config="dataclasses.replace(transformer.config, attn='orthros', window=window)",
                  model="Orthros(config).to(transformer.wte.weight.dtype)", state="transformer.state_dict()"):
    return (f"config = {config}\nmodel = {model}\nmodel.load_state_dict({state}, strict=False)\n"
            "with torch.no_grad():\n    for block in model.blocks:\n"
            "        block.attn.alpha.fill_(1.0), block.attn.alpha_out.fill_(1.0)\n"
            "        block.attn.beta.zero_(), block.attn.beta_out.zero_()\nreturn model")


MUTANTS = [
    Mutant("orthros.py's conversion called", make_bug(reference=True),
           expect="your code called orthros.Orthros.load_transformer_weights"),
    Mutant("the Transformer's config changed", SimpleNamespace(convert=convert_in_place),
           expect="changed its input `transformer`: `transformer.config.window` was 32, now 4"),
    Mutant("the stored solution imported", source="from exercises.solutions.ex05_conversion import convert\n",
           expect="is not available to your code"),
    Mutant("orthros.py's conversion kept at import time",
           source=student_file("model = Orthros(dataclasses.replace(transformer.config, attn='orthros', window=window))\n"
                               "_load(model, transformer.state_dict())\nreturn model.to(transformer.wte.weight.dtype)")
           + "\n\n_load = Orthros.load_transformer_weights\n",
           expect="holds orthros.Orthros.load_transformer_weights"),
    Mutant("the model made float64", source=student_file(solution_body(model="Orthros(config).double()")),
           expect="has dtype torch.float64, expected torch.float32"),
    Mutant("the Transformer cast to float64 in place", source=student_file(solution_body(
        model="Orthros(config).double()", state="transformer.double().state_dict()")),
        expect="changed its input `transformer`"),
    Mutant("the Transformer put in eval mode", source=student_file(solution_body(
        state="transformer.eval().state_dict()")), expect="`transformer.training` was True, now False"),
    Mutant("the Transformer frozen", source=student_file(solution_body(
        state="transformer.requires_grad_(False).state_dict()")), expect="`transformer.wte.weight.requires_grad` was True, now False"),
    Mutant("the config rebuilt from the fields that seemed to matter", source=student_file(solution_body(config=(
        "OrthrosConfig(vocab_size=transformer.config.vocab_size, n_layer=transformer.config.n_layer, "
        "n_head=transformer.config.n_head, n_embd=transformer.config.n_embd, window=window, attn='orthros', "
        "max_seq_len=transformer.config.max_seq_len)"))), expect="rope_base"),
    Mutant("the paper's window written in", source=student_file(solution_body(
        config="dataclasses.replace(transformer.config, attn='orthros', window=128)")), expect="at ['window']"),
    Mutant("a deep copy of the Transformer, relabelled", source=student_file(
        "model = copy.deepcopy(transformer)   # every weight copied, the names kept\n"
        "model.config = dataclasses.replace(transformer.config, attn='orthros', window=window)\nreturn model"),
        expect="your model's scale-offsets"),
]


def cases(**options):
    transformer = tiny_model("transformer", randomize=False, window=32)
    conv = tiny_model("transformer", randomize=False, window=32, conv_kernel=3, seed=1)
    other = tiny_model("transformer", randomize=False, seed=2, vocab_size=41, n_layer=3, n_head=4, n_embd=48,
                       rope_base=500.0, dropout=0.1, swa_impl="dense", max_seq_len=300).train()
    about_other = ("another Transformer: n_layer=3, n_head=4, C=48, rope_base=500.0, dropout=0.1, swa_impl='dense', "
                   "max_seq_len=300, in train mode")
    idx = tokens(2, 24)
    found = structure(transformer, 4)
    for model, what in ((transformer, "the Transformer"), (conv, "a Transformer with conv_kernel=3")):
        for t_out in (24, 5):
            found.append(logits_case(model, what, 32, idx, t_out))
    found.append(logits_case(transformer, "the Transformer", 4, idx, 24))
    # One dimension at a time, each named in the case: what an answer could have written in
    found += structure(transformer, 4, "a float32 Transformer", dtype=torch.float32)[1:2]
    found.append(logits_case(transformer, "a float32 Transformer", 32, idx, 5, dtype=torch.float32))
    found += structure(other, 5, about_other)
    found.append(logits_case(other, about_other, 5, tokens(3, 24, vocab=41), 24))
    # The paper's sizes: w = 128 over T = 300
    found.append(logits_case(transformer, "the Transformer", 128, tokens(2, 300), 300))
    return found


def structure(transformer, window, about="the Transformer", dtype=None):
    """The converted model's config, weights, scale-offsets and storage, each a case."""
    call = f"convert(transformer, window={window}), transformer: {about}"
    invariant = "" if dtype is None else f", {str(dtype).replace('torch.', '')} here"
    return [
        Case(f"dataclasses.asdict(model.config), model = {call}",
             inputs=lambda: dict(transformer=transformer, window=window),
             call=lambda answer, transformer, window: dataclasses.asdict(converted(answer, transformer, window).config),
             invariant="the Transformer's config with attn='orthros' and the new window; nothing else changes",
             expected=lambda transformer, window: dataclasses.asdict(
                 dataclasses.replace(transformer.config, attn="orthros", window=window)),
             output="your model's config", dtype=dtype),
        Case(f"the converted model's state dict, at the Transformer's names: model = {call}",
             inputs=lambda: dict(transformer=transformer, window=window),
             call=lambda answer, transformer, window: shared_weights(converted(answer, transformer, window), transformer),
             invariant="every Transformer weight is copied exactly, under its own name, in its dtype (a pure weight "
                       f"copy{invariant})",
             expected=lambda transformer, window: {k: w.clone() for k, w in transformer.state_dict().items()},
             output="your model's state dict", dtype=dtype),
        Case(f"the converted model's scale-offsets (the names the Transformer lacks): model = {call}",
             inputs=lambda: dict(transformer=transformer, window=window),
             call=lambda answer, transformer, window: new_parameters(converted(answer, transformer, window), transformer),
             invariant="the scale-offsets start at the identity, alpha = alpha' = 1, beta = beta' = 0 (as "
                       "orthros.py's load_transformer_weights leaves them)",
             expected=lambda transformer, window: new_parameters(reference_conversion(transformer, window), transformer),
             output="your model's scale-offsets", dtype=dtype),
        Case(f"which of the converted model's tensors share memory with the Transformer's: model = {call}",
             inputs=lambda: dict(transformer=transformer, window=window),
             call=lambda answer, transformer, window: sharing(converted(answer, transformer, window), transformer),
             invariant="the converted model owns copies: training it must leave the Transformer unchanged",
             holds=lambda shared: f"{len(shared)} tensors are the Transformer's own, e.g. {shared[0]}" if shared else None,
             dtype=dtype),
    ]


def logits_case(model, what, window, idx, t_out, dtype=None):
    B, T = idx.shape
    if window >= T:
        invariant, expected = "with w >= T and identity scale-offsets, Orthros gives the Transformer's logits", \
            lambda transformer, window, idx, t_out: logits(transformer.eval(), idx, t_out)
    else:
        invariant, expected = "with w < T the converted model computes what orthros.py's own conversion computes", \
            lambda transformer, window, idx, t_out: logits(reference_conversion(transformer, window), idx, t_out)
    exact = "in float64, to 1e-12" if dtype is None else "in float32, to 1e-5"
    return Case(
        f"convert(transformer, window={window})(idx, t_out={t_out})[0], idx of shape ({B}, {T}), transformer: {what}",
        inputs=lambda: dict(transformer=model, window=window, idx=idx, t_out=t_out),
        call=converted_logits, invariant=f"{invariant} ({exact})", atol=1e-12 if dtype is None else 1e-5,
        expected=expected, output="your model's logits", dtype=dtype)


def converted(answer, transformer, window):
    trainable = {name: p.requires_grad for name, p in transformer.named_parameters()}
    model = answer.convert(transformer, window)   # its form (an Orthros) is checked on return
    for name, p in transformer.named_parameters():   # what the inputs' check (weights by value) does not see
        if p.requires_grad != trainable.get(name, p.requires_grad):
            raise Wrong(f"your convert changed its input `transformer`: `transformer.{name}.requires_grad` was "
                        f"{trainable[name]}, now {p.requires_grad}")
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
    model = Orthros(dataclasses.replace(transformer.config, attn="orthros", window=window))
    model = model.to(transformer.wte.weight.dtype)
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
