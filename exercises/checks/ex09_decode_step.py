"""Exercise 9, the KV-cache decode step: the checker."""

import contextlib
import copy
import inspect
from types import SimpleNamespace
from unittest import mock

import torch

from exercises.framework import Bug, Case, Mutant, Wrong, describe, form_difference, handed_to_blocks, short, tiny_model, tokens
from exercises.solutions import ex09_decode_step as solution
from orthros import KVCache, Orthros, OrthrosConfig, rope_cos_sin
from perf import engine

TITLE = "The KV-cache decode step"
DIFFICULTY = 4
MINUTES = 40
TEACHES = "decode = a forward with T = 1, t_out = 1 over the cache; train == prefill + decode; the cache keeps every position"
FUNCTIONS = ("decode_step",)
REFERENCE = SimpleNamespace(decode_step=solution.decode_step)
THE_STEP = "it runs the forward pass (or the whole decode step) this exercise asks you to build from the blocks"
FORBIDDEN = {inspect.unwrap(fn): THE_STEP for fn in (
    Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens,
    *(getattr(engine.FastDecoder, name) for name in ("prefill", "decode", "load") if hasattr(engine.FastDecoder, name)),
    *(getattr(engine, name) for name in ("layer_in", "layer_out", "decode_attention") if hasattr(engine, name)))}
PAPER = "the paper's widths (n_embd 768, 6 heads, vocab_size 50304, w=128)"

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


BLOCK = "z = block(z, 1, rope, layer_cache)"
EMBED = "x = model.wte(next_idx.reshape(-1, 1))"
TWINS = "z = torch.cat([x, x], dim=1) if orthros else x"
LOGITS = "model.lm_head(model.ln_f(z[:, -1:]))"
BUGS = [
    Bug("the blocks run without the cache", "block(z, 1, rope) without the layer's cache lets the new token attend only "
        "itself, and the cache never grows: give block l its cache.layers[l].", {BLOCK: "z = block(z, 1, rope)"}),
    Bug("the RoPE position off by one", "the new token sits at position S = cache.length (the prompt filled 0 ... S-1), "
        "not S + 1.", {"(z.size(1),), S,": "(z.size(1),), S + 1,"}),
    Bug("a sliding-window cache (only the last w positions kept)", "right for SWA, wrong for Orthros: the output tokens "
        "attend every position, so the cache must keep them all.",
        {BLOCK: BLOCK + "\n            w = model.config.window   # only the window is ever attended\n"
                "            layer_cache.k, layer_cache.v = layer_cache.k[:, :, -w:], layer_cache.v[:, :, -w:]"}),
]

MUTANTS = [
    Mutant("logits of shape (B, vocab)", "your logits have shape (2, 37), expected (2, 1, 37)", {LOGITS: LOGITS.replace("-1:", "-1")}),
    Mutant("the model's own decode called", "your code called orthros.Orthros.decode",
           source="def decode_step(model, next_idx, cache):\n    return model.decode(next_idx, cache)\n"),
    Mutant("Orthros.forward captured at import", "holds orthros.Orthros.forward",
           source="from orthros import Orthros\n\n_forward = Orthros.forward\n\n\ndef decode_step(model, next_idx, cache):\n"
                  "    return _forward(model, next_idx.reshape(-1, 1), t_out=1, cache=cache)[0], cache\n"),
    Mutant("rope_base hard-coded (10000)", "rope_base 10000.0 (config.rope_base is 500.0)", {"model.config.rope_base,": "10000.0,"}),
    Mutant("head_dim from n_layer", "must match the size of tensor b (8)", {"// model.config.n_head": "// model.config.n_layer"}),
    Mutant("an output twin for SWA too", "right keys and values at every layer", {TWINS: "z = torch.cat([x, x], dim=1)"}),
    Mutant("Orthros's output twin left out", "right keys and values at every layer", {TWINS: "z = x"}),
    Mutant("the logits in float64 (.double())", "your logits have dtype torch.float64, expected torch.float32",
           {LOGITS: LOGITS + ".double()"}),
    Mutant("the RoPE tables in float32 whatever the model (rope_cos_sin's default dtype)", "in bfloat16",
           {",\n                        model.wte.weight.dtype)": ")"}),
    Mutant("the embedding made float32 and back", "about float32's rounding",
           {EMBED: EMBED + ".float().to(model.wte.weight.dtype)   # float32 holds an embedding"}),
    Mutant("next_idx of shape (B, 1) made (B, 1, 1, C)", "next_idx of shape (2, 1)", {EMBED: "x = model.wte(next_idx)[:, None]"}),
    Mutant("next_idx.squeeze() (a 0-d index when B = 1)", "next_idx of shape (1,)",
           {EMBED: "x = model.wte(next_idx.squeeze()).unsqueeze(1)"}),
    Mutant("next_idx unsqueezed on the wrong side", "your code hands block 0 z of", {EMBED: "x = model.wte(next_idx.unsqueeze(0))"}),
    Mutant("both twins handed to the blocks as base tokens", "your code hands block 0 T=2", {BLOCK: "z = block(z, z.size(1), rope, layer_cache)"}),
    Mutant("the convolution's state dropped each step", "conv_state",
           {BLOCK: "layer_cache.conv_state = None   # a fresh start for the new token\n            " + BLOCK}),
    Mutant("cache.length not advanced", "cache.length is 12; it must become 13", {"        cache.length = S + 1\n": ""}),
    Mutant("the positions made on the CPU", "is not on the expected device meta", {"device=x.device)": "device='cpu')"}),
]

ALSO_RIGHT = """import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    B = next_idx.shape[0]
    x = model.wte(next_idx.view(B, 1))
    rows = 2 if model.config.attn == 'orthros' else 1
    z = x.expand(B, rows, x.size(-1))
    where = torch.tensor([cache.length] * rows, device=next_idx.device)
    rope = rope_cos_sin(where, model.blocks[0].attn.head_dim, model.config.rope_base, model.lm_head.weight.dtype)
    with torch.no_grad():
        for l, block in enumerate(model.blocks):
            z = block(z, 1, rope, cache.layers[l])
        cache.length += 1
        return model.lm_head(model.ln_f(z))[:, -1:], cache
"""


# -- Cases --------------------------------------------------------------------------------------

MODELS = {   # name: (attn, overrides, dtype)
    "attn='orthros'": ("orthros", {}, None),
    "attn='orthros', conv_kernel=3": ("orthros", dict(conv_kernel=3), None),
    "attn='swa'": ("swa", {}, None),
    "attn='transformer'": ("transformer", {}, None),
    "attn='orthros', 3 layers, 4 heads, n_embd=24, w=3, rope_base=500.0, dropout=0.1 (eval mode), vocab_size=50, "
    "conv_kernel=2, seed 1": ("orthros", dict(n_layer=3, n_head=4, n_embd=24, window=3, rope_base=500.0, dropout=0.1,
                                              vocab_size=50, conv_kernel=2, seed=1), None),
    "attn='orthros', float32": ("orthros", dict(seed=2), torch.float32),
    "attn='orthros', bfloat16": ("orthros", dict(seed=2), torch.bfloat16),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
T = 13
# (p, models, batch, next_idx as (B, 1)): the fewest decode steps first
RUNS = [(12, list(MODELS), 2, False), (12, ["attn='orthros'"], 2, True), (12, ["attn='orthros'"], 1, False),
        (11, list(MODELS)[4:5], 3, True), (4, list(MODELS)[:6], 2, False), (1, ["attn='orthros'"], 2, False)]
PAPER_SIZE = dict(n_layer=2, n_embd=768, n_head=6, vocab_size=50304, window=128)   # 2 of its 12 layers: meta is slow


def cases(**options):
    models = {}
    for name, (attn, overrides, dtype) in MODELS.items():
        overrides = dict(overrides)
        models[name] = tiny_model(attn, seed=overrides.pop("seed", 0), **overrides)
    for p, names, B, column in RUNS:
        for name in names:
            dtype, c = MODELS[name][2], models[name].config
            yield Case(
                f"prefill(idx[:, :{p}]), then {T - p} decode_step(s) with the tokens idx[:, {p}:], each as next_idx of "
                f"shape {f'({B}, 1)' if column else f'({B},)'}; idx of shape ({B}, {T}), {name}, w={c.window}, {c.n_layer} layers",
                inputs=lambda model=models[name], p=p, B=B, column=column: dict(model=model, idx=tokens(B, T, seed=B), p=p,
                                                                                column=column),
                call=lambda answer, model, idx, p, column: decoded(answer, model, idx, p, column)[0], dtype=dtype,
                invariant="train == decode: the logits of each decode step equal those of one training forward over the "
                          "whole sequence, at positions p ... T-1; after each step the cache holds the keys and values of "
                          "every position so far, and cache.length is the next token's position" +
                          (f" (in {str(dtype)[6:]}, to {TOLERANCE[dtype]:g})" if dtype else ""),
                atol=TOLERANCE.get(dtype, 1e-10), rtol=TOLERANCE.get(dtype, 0.0) if dtype == torch.bfloat16 else 0.0,
                expected=lambda model, idx, p, column: [model(idx)[0][:, t:t + 1].detach() for t in range(p, T)], output="your logits of the decode steps")
    yield Case(
        f"the cache after prefill(idx[:, :1]) and {T - 1} decode steps: cache.layers[l].k, .v (and .conv_state) for each "
        "layer, then cache.length; attn='orthros', conv_kernel=3", output="your cache's tensors",
        inputs=lambda: dict(model=models["attn='orthros', conv_kernel=3"], idx=tokens(2, T), p=1),
        call=lambda answer, model, idx, p: cache_contents(decoded(answer, model, idx, p)[1]),
        invariant="the cache keeps every position: it equals the cache of prefill(idx) over the whole sequence",
        atol=1e-10, expected=lambda model, idx, p: cache_contents(model.prefill(idx)[1]))
    with torch.device("meta"):   # built once, when a check gets here: every operation on meta runs in Python
        paper = Orthros(OrthrosConfig(**PAPER_SIZE)).eval()
    yield Case(
        "a decode_step on the meta device after 300 positions (a KVCache whose layers hold k, v of shape (2, 6, 300, 128), "
        f"cache.length = 300): 2 layers at {PAPER}, next_idx of shape (2,)", call=decoded_on_meta, device="meta", output="your logits",
        inputs=lambda: dict(model=paper, next_idx=torch.zeros(2, dtype=torch.long)),
        invariant="the logits (B, 1, vocab) made where the model is (here: meta, where only shapes exist)")


def decoded_on_meta(answer, model, next_idx, S=300):
    """One decode step of the paper's model on the meta device, after a cache of S positions made by hand (a prefill on
    meta would cost seconds: every meta operation runs in Python)."""
    cache = KVCache(model, next_idx.size(0))
    for layer in cache.layers:
        layer.k, layer.v = (torch.empty(next_idx.size(0), model.config.n_head, S, model.config.n_embd // model.config.n_head,
                                        device=next_idx.device) for _ in range(2))
    cache.length = S
    return answer.decode_step(model, next_idx, cache)[0]


def decoded(answer, model, idx, p, column=False):
    """The logits of the answer's decode steps after prefill(idx[:, :p]) (a list, one (B, 1, vocab) per step), and the
    final cache. What each step hands the blocks is checked before they run; after each step of an answer, its logits
    and cache are compared with the stored solution's step from the same cache: the first wrong step is reported."""
    _, cache = model.prefill(idx[:, :p])
    explain = inspect.unwrap(answer.decode_step) is not solution.decode_step
    with torch.no_grad():
        full = model(idx)[0]
    steps, before = [], [None]

    def carried(i, given):   # its layer's cache, with the convolution's state as this step found it
        if given.get("cache") is None:
            return f"no layer cache: give it cache.layers[{i}], which it reads and appends the new key and value to"
        expected, got = getattr(before[0].layers[i], "conv_state", None), getattr(given["cache"], "conv_state", None)
        if expected is not None and not (isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got, expected)):
            return (f"a layer cache whose conv_state is {short(got, 40)}, not the state cache.layers[{i}].conv_state held "
                    "before this step: the convolution's state (its last k-1 inputs) must carry over from step to step")
    for t in range(p, idx.size(1)):
        before[0] = copy.deepcopy(cache) if explain else None
        next_idx = idx[:, t:t + 1] if column else idx[:, t]
        with handed_to_blocks(model, idx.size(0), None, 1, "one new token per sequence: z is (B, rows, C), its base "
                              "twin the first row", carried) if explain else contextlib.nullcontext():
            step = answer.decode_step(model, next_idx, cache)
        problem = f"your decode_step returned {describe(step)}, expected (logits, cache)" if not isinstance(
            step, (tuple, list)) or len(step) != 2 else form_difference(step[0], full[:, t:t + 1], "your logits")
        if problem:
            raise Wrong(problem)
        logits, cache = step
        steps.append(logits)
        problem = explain and step_problem(model, next_idx, before[0], logits, cache, full[:, t:t + 1], t - p + 1)
        if problem:
            raise Wrong(problem)
    return steps, cache


def reference_step(model, next_idx, before, shift=0, base=None):
    """The cache after the stored solution's step from a copy of `before`, or after that step with RoPE at another
    position or base."""
    turned = lambda positions, D, b, dtype: rope_cos_sin(positions + shift, D, base or b, dtype)
    with mock.patch.object(solution, "rope_cos_sin", turned):
        return solution.decode_step(model, next_idx, copy.deepcopy(before))[1]


def step_problem(model, next_idx, before, logits, cache, right, k):
    """What is wrong with decode step k (logits, cache), from the cache `before` it, in words; None if nothing."""
    S, atol, ref = before.length, TOLERANCE.get(model.wte.weight.dtype, 1e-10), reference_step(model, next_idx, before)
    step = f"after your decode step {k} (the token at position {S})"
    if getattr(cache, "length", None) != S + 1:
        return f"{step}, cache.length is {short(getattr(cache, 'length', None))}; it must become {S + 1}, the position of the next token"
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or len(layers) != len(ref.layers):
        return f"{step}, cache.layers is {short(layers, 60)}: expected a list of {len(ref.layers)} LayerCaches"
    for l, name in ((l, name) for l in range(len(layers)) for name in ("k", "v", "conv_state")):
        expected, got, where = getattr(ref.layers[l], name), getattr(layers[l], name, None), f"cache.layers[{l}].{name}"
        if expected is None:
            continue
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return (f"{step}, {where} is {short(got, 60) if not isinstance(got, torch.Tensor) else f'a tensor of shape {tuple(got.shape)}'}"
                    f", expected shape {tuple(expected.shape)}" + (f" (every position so far: S + 1 = {S + 1})" if name != "conv_state" else ""))
        err = (got.double() - expected.double()).abs()
        if err.max() > atol and name == "conv_state":
            return f"{step}, {where} differs from the reference's by up to {err.max():.3g}"
        if err.max() > atol:
            position = int((err.amax(dim=(0, 1, 3)) > atol).nonzero()[0])
            return f"{step}, {where} changed at position {position}: a step appends, it never changes the past" \
                if position < S else f"{step}, {new_key(model, next_idx, before, cache, l, name, err.max(), atol)}"
    gap = (logits.double() - right.double()).abs().max()
    if gap > atol:
        return (f"{step}, your cache is right (cache.length and every layer's keys and values), but your logits differ from "
                f"the training forward's by up to {gap:.3g}: you appended the right keys and values at every layer; what is "
                "wrong comes after them: for Orthros, z holds the base twin then the output twin, and the LM head reads the "
                "output twin's row (z[:, -1:], then ln_f, then lm_head)")
    return None


def new_key(model, next_idx, before, cache, l, name, err, atol):
    """The key (or value) a step appended at layer l is wrong: which RoPE it was made with, if one fits."""
    where = f"the {'key' if name == 'k' else 'value'} your step appended to cache.layers[{l}].{name}"
    variants = [("RoPE at position S + 1 (S = cache.length)", dict(shift=1)), ("RoPE at position S - 1 (S = cache.length)",
                                                                             dict(shift=-1))]
    if model.config.rope_base != 10000.0:
        variants.append((f"rope_base 10000.0 (config.rope_base is {model.config.rope_base})", dict(base=10000.0)))
    for label, how in variants:
        expected, got = getattr(reference_step(model, next_idx, before, **how).layers[l], name), getattr(cache.layers[l], name)
        if got.shape == expected.shape and (got.double() - expected.double()).abs().max() <= atol:
            return f"{where} is the one made with {label}"
    hint = (": what enters the first block (the embedding of next_idx, the rows of z) or its RoPE tables (the position "
            "S = cache.length, config.rope_base, head_dim = n_embd // n_head, the weights' dtype)") if l == 0 else \
        ": the layers before it were right"
    rounding = " (about float32's rounding)" if model.wte.weight.dtype == torch.float64 and err < 1e-5 else ""
    return f"{where} differs from the reference's by up to {err:.3g}{rounding}{hint}"


def cache_contents(cache):
    return [t for layer in cache.layers for t in (layer.k, layer.v, layer.conv_state) if t is not None] + [cache.length]
