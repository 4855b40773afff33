"""Exercise 5, converting a Transformer: the checker."""

import dataclasses
from types import SimpleNamespace

import torch

from exercises.framework import ZOO, Bug, Case, Mutant, Wrong, describe, tiny_model, tokens, using
from orthros import Orthros

TITLE, DIFFICULTY, MINUTES = "Converting a Transformer", 3, 30
FUNCTIONS = ("convert",)


def orthros_conversion(transformer, window):
    """The reference: orthros.py's own conversion, live (the stored solution is checked against it)."""
    model = Orthros(dataclasses.replace(transformer.config, attn="orthros", window=window)).to(transformer.wte.weight.dtype)
    model.load_transformer_weights(transformer.state_dict())
    return model.train(transformer.training)


REFERENCE = SimpleNamespace(convert=orthros_conversion)
FORBIDDEN = {Orthros.load_transformer_weights: "orthros.py's own conversion, which this exercise asks you to write"}
PAPER = "window=128)(idx, t_out=300)"

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

CONFIG = 'config = dataclasses.replace(transformer.config, attn="orthros", window=window)'
BUILT = "model = Orthros(config).to(transformer.wte.weight.dtype)"
LOADED = "model.load_state_dict(transformer.state_dict(), strict=False)"
BUGS = [
    Bug("the scale-offsets at zero", "alpha = 0 multiplies every query by 0 (uniform attention); the identity is alpha = "
        "alpha' = 1, beta = beta' = 0.", {"alpha.fill_(1.0), attn.alpha_out.fill_(1.0)": "alpha.zero_(), attn.alpha_out.zero_()"}),
    Bug("a sliding-window model, not Orthros", "attn='swa' keeps the window but drops the output stream's full "
        "cross-attention: set attn='orthros'.", {'attn="orthros", window=window': 'attn="swa", window=window'}),
    Bug("the Transformer's tensors shared, not copied", "assigning the Transformer's Parameters makes both models one: "
        "training the converted model would change the Transformer too.",
        {LOADED: "for name, p in transformer.named_parameters():   # the Transformer's own tensors\n"
                 "        module, _, attr = name.rpartition('.')\n        setattr(model.get_submodule(module), attr, p)\n"
                 "    model.lm_head.weight = model.wte.weight"}),
]
MUTANTS = [
    Mutant("orthros.py's conversion called", "your code called orthros.Orthros.load_transformer_weights",
           {LOADED: "model.load_transformer_weights(transformer.state_dict())"}),
    Mutant("the Transformer's config changed", "changed its input `transformer`: `transformer.config.window` was 32, now 4",
           {CONFIG: "transformer.config = " + CONFIG}),
    Mutant("the stored solution imported", "is not available to your code",
           source="from exercises.solutions.ex05_conversion import convert\n"),
    Mutant("orthros.py's conversion kept at import time", "holds orthros.Orthros.load_transformer_weights",
           {"    return model.train(transformer.training)": "    return model.train(transformer.training)\n\n\n"
                                                            "_load = Orthros.load_transformer_weights"}),
    Mutant("the model made float64", "has dtype torch.float64, expected torch.bfloat16", {BUILT: "model = Orthros(config).double()"}),
    Mutant("the Transformer cast to float64 in place", "changed its input `transformer`",
           {BUILT: "model = Orthros(config).double()", LOADED: "model.load_state_dict(transformer.double().state_dict(), strict=False)"}),
    Mutant("the Transformer put in eval mode", "`transformer.training` was True, now False",
           {LOADED: "model.load_state_dict(transformer.eval().state_dict(), strict=False)"}),
    Mutant("the Transformer frozen", "`transformer.wte.weight.requires_grad` was True, now False",
           {LOADED: "model.load_state_dict(transformer.requires_grad_(False).state_dict(), strict=False)"}),
    Mutant("the config rebuilt from the fields that seemed to matter", "rope_base",
           {CONFIG: "c = transformer.config\n    config = OrthrosConfig(vocab_size=c.vocab_size, n_layer=c.n_layer, n_head="
                    "c.n_head, n_embd=c.n_embd, window=window, attn='orthros', max_seq_len=c.max_seq_len)",
            "from orthros import Orthros": "from orthros import Orthros, OrthrosConfig"}),
    Mutant("the paper's window written in", "at ['window']", {'window=window)': "window=128)"}),
    Mutant("a deep copy of the Transformer, relabelled", "your model's scale-offsets",
           {CONFIG: "model = __import__('copy').deepcopy(transformer)   # every weight copied, the names kept\n"
                    "    model.config = dataclasses.replace(transformer.config, attn='orthros', window=window)\n"
                    "    return model"}),
    Mutant("the weights copied through a float32 model", "about float32's rounding",
           {BUILT: "model = Orthros(config)", "return model.train(": "return model.to(transformer.wte.weight.dtype).train("}),
    Mutant("the LM head tied to the embedding", "untied head", {LOADED: LOADED + "\n    model.lm_head.weight = model.wte.weight"}),
    Mutant("only the matrices copied", "ln_1.weight", {LOADED: "for name, w in transformer.state_dict().items():\n        if "
                                                        "w.dim() == 2:\n            model.get_parameter(name).data.copy_(w)"}),
    Mutant("requires_grad_(False) to fill them in place", "requires_grad", {"with torch.no_grad():": "if model.requires_grad_(False):"}),
    Mutant("the scale-offsets filled whatever the config", "scale_offset=False", {" if block.attn.scale_offset)": ")"}),
    Mutant("convert cached with functools.lru_cache: one model for every call", "the first model changed in place",
           {"def convert(": "@__import__('functools').lru_cache(maxsize=None)\ndef convert("}),
]
OTHER = dict(seed=2, vocab_size=41, n_layer=3, n_head=4, n_embd=48, rope_base=500.0, dropout=0.1, swa_impl="dense",
             max_seq_len=300)
ABOUT = "another Transformer, in train mode: " + ", ".join(f"{k}={v!r}" for k, v in OTHER.items())


def cases(**options):
    transformer = tiny_model("transformer", window=32)
    conv = tiny_model("transformer", window=32, conv_kernel=3, seed=1)
    other = tiny_model("transformer", **OTHER).train()
    idx = tokens(2, 24)
    found = structure(transformer, 4) + structure(other, 5, ABOUT)
    found += [logits_case(model, what, 32, idx, t_out) for model, what in ((transformer, "the Transformer"),
                                                                           (conv, "one with conv_kernel=3")) for t_out in (24, 5)]
    found.append(logits_case(transformer, "the Transformer", 4, idx, 24))
    found.append(Case("convert(transformer, window=4) twice, the first model changed in place between the calls (as "
                      "training it would: its wte.weight += 1); the second model's state dict", dict(transformer=transformer,
                      window=4), converted_twice, "each call returns a new model: training the first converted model "
                      "changes no later one", output="your second model's state dict"))
    # One dimension at a time, each named in the case: what an answer could have written in
    for name, more, dtype in ZOO:
        member = tiny_model("transformer", window=32, **more)
        found += structure(member, 4, f"{name}, a Transformer", dtype) + [logits_case(member, name, 4, idx, 24, dtype)]
    found.append(logits_case(other, ABOUT, 5, tokens(3, 24, vocab=41), 24))
    return found + [logits_case(transformer, "the Transformer", 128, tokens(2, 300), 300)]   # the paper's window, T = 300


def structure(transformer, window, about="the Transformer", dtype=None):
    """The converted model's config, weights and scale-offsets, each a case."""
    def case(what, view, invariant, **more):
        return Case(f"{what}: model = convert(transformer, window={window}), transformer: {about}",
                    dict(transformer=transformer, window=window), lambda answer, transformer, window: view(
                        converted(answer, transformer, window), transformer), invariant, dtype=dtype, **more)
    return [case("dataclasses.asdict(model.config)", lambda model, t: dataclasses.asdict(model.config), output="your "
                 "model's config", invariant="the Transformer's config with attn='orthros' and the new window, nothing else"),
            case("the converted model's state dict, at the Transformer's names", transformer_names, output="your model's "
                 "state dict", invariant="every Transformer weight copied exactly, under its own name, in its dtype"),
            case("the converted model's scale-offsets (the names the Transformer lacks)", lambda model, t: {
                k: w for k, w in model.state_dict().items() if k not in t.state_dict()}, output="your model's scale-offsets",
                invariant="the scale-offsets start at the identity, alpha = alpha' = 1, beta = beta' = 0"),
            case("{name: p.requires_grad for name, p in model.named_parameters()}", lambda model, t: {
                name: p.requires_grad for name, p in model.named_parameters()}, output="what of your model trains",
                invariant="every parameter of the converted model trains, as the Transformer's did")]


def logits_case(model, what, window, idx, t_out, dtype=None):
    B, T = idx.shape
    same = window >= T   # then the converted model is the Transformer
    return Case(f"convert(transformer, window={window})(idx, t_out={t_out})[0], idx of shape ({B}, {T}), transformer: {what}",
                dict(transformer=model, window=window, idx=idx, t_out=t_out), converted_logits, dtype=dtype,
                invariant="with w >= T and identity scale-offsets, Orthros gives the Transformer's logits" if same else
                          "with w < T the converted model computes what orthros.py's own conversion computes",
                expected=(lambda transformer, idx, t_out, **_: transformer.eval()(idx, t_out=t_out)[0].detach()) if same
                else None, output="your model's logits")


def converted(answer, transformer, window):
    model = answer.convert(transformer, window)
    if not isinstance(model, Orthros):
        raise Wrong(f"your convert returned {describe(model)}, expected an Orthros model")
    with using("your model's .eval()"):
        return model.eval()


def converted_twice(answer, transformer, window):
    with torch.no_grad():
        converted(answer, transformer, window).wte.weight.add_(1.0)
    return transformer_names(converted(answer, transformer, window), transformer)


def converted_logits(answer, transformer, window, idx, t_out):
    model = converted(answer, transformer, window)
    with using(f"your model(idx, t_out={t_out})"), torch.no_grad():
        return model(idx, t_out=t_out)[0]


def transformer_names(model, transformer):
    own = model.state_dict()
    return {k: own.get(k, "missing") for k in transformer.state_dict()}
