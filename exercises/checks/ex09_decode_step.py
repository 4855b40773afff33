"""Exercise 9, the KV-cache decode step: the checker, hints and known bugs."""

import inspect
from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, tiny_model, tokens
from exercises.solutions import ex09_decode_step as solution
from orthros import Orthros, rope_cos_sin
from perf import engine

TITLE = "The KV-cache decode step"
DIFFICULTY = 4
MINUTES = 40
TEACHES = "decode = a forward with T = 1, t_out = 1 over the cache; train == prefill + decode; the cache keeps every position"
FUNCTIONS = ("decode_step",)
REFERENCE = SimpleNamespace(decode_step=solution.decode_step)
RETURNS = {"decode_step": ("logits", "cache")}
THE_STEP = "it runs the forward pass (or the whole decode step) this exercise asks you to build from the blocks"
FORBIDDEN = {inspect.unwrap(fn): THE_STEP for fn in (
    Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens,
    *(getattr(engine.FastDecoder, name) for name in ("prefill", "decode", "load") if hasattr(engine.FastDecoder, name)),
    *(getattr(engine, name) for name in ("decode_layer", "decode_attention") if hasattr(engine, name)))}

HINTS = [
    "Decoding is the same forward pass with T = 1 and t_out = 1: one base token and (for Orthros) one "
    "output token, both at the new position S = cache.length. Each block gets its layer's cache: the "
    "block appends the base token's key and value to it, so the next step sees this token. Then advance "
    "cache.length and read the logits from the output twin.",
    "Shapes, step by step (S = cache.length before the step, C = n_embd, D = C / n_head):\n"
    "1. next_idx (B,) or (B, 1) -> embeddings (B, 1, C)\n"
    "2. z: Orthros, the base twin then the output twin, (B, 2, C); the baselines, the base token alone, (B, 1, C)\n"
    "3. RoPE tables for z's rows, every row at position S: (rows, D) each, in the weights' dtype\n"
    "4. for each layer l: z -> block(z, T=1, rope, that layer's LayerCache) -> z; afterwards "
    "cache.layers[l].k is (B, H, S + 1, D)\n"
    "5. cache.length becomes S + 1; the logits: the final norm and the LM head on z's last row, (B, 1, vocab)\n"
    "6. return (logits, cache)",
    "Paper, section 3.2, Decoding (T_in = 0, T_out = 1): 'each step processes exactly one generated token "
    "(T = 1). This single token is duplicated to form the decoupled pair: the base token updates the KV cache "
    "and computes sliding window attention, while the output-specific token performs full cross-attention "
    "against the historical cache'. In orthros.py: Orthros.forward with a cache, and Orthros.decode.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

class WindowOnly:
    """A layer cache that appends like LayerCache, then keeps only the last w positions."""

    def __init__(self, layer, window):
        self.layer, self.window = layer, window

    def append(self, k, v):
        k, v = self.layer.append(k, v)
        self.layer.k, self.layer.v = k[:, :, -self.window:], v[:, :, -self.window:]
        return self.layer.k, self.layer.v

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __setattr__(self, name, value):
        if name in ("layer", "window"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.layer, name, value)


def make_bug(no_cache=False, position_shift=0, keep_window=False, flat_logits=False):
    def decode_step(model, next_idx, cache):
        x = model.wte(next_idx.reshape(-1, 1))
        z = torch.cat([x, x], dim=1) if model.config.attn == "orthros" else x
        position = torch.full((z.size(1),), cache.length + position_shift)
        rope = rope_cos_sin(position, model.config.n_embd // model.config.n_head, model.config.rope_base,
                            model.wte.weight.dtype)
        with torch.no_grad():
            for block, layer in zip(model.blocks, cache.layers):
                if no_cache:
                    layer = None
                elif keep_window:
                    layer = WindowOnly(layer, model.config.window)
                z = block(z, 1, rope, layer)
            cache.length += 1
            logits = model.lm_head(model.ln_f(z[:, -1:]))
            return (logits[:, 0] if flat_logits else logits), cache
    return SimpleNamespace(decode_step=decode_step)


BUGS = [
    Bug("the blocks run without the cache", "block(z, 1, rope) without the layer's cache lets the new token "
        "attend only itself, and the cache never grows: give block l its cache.layers[l].", make_bug(no_cache=True)),
    Bug("the RoPE position off by one", "the new token sits at position S = cache.length (the prompt filled "
        "0 ... S-1), not S + 1.", make_bug(position_shift=1)),
    Bug("a sliding-window cache (only the last w positions kept)", "right for SWA, wrong for Orthros: the "
        "output tokens attend every position, so the cache must keep them all.", make_bug(keep_window=True)),
]


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

MUTANTS = [
    Mutant("logits of shape (B, vocab)", make_bug(flat_logits=True),
           expect="your logits have shape (2, 37), expected (2, 1, 37)"),
    Mutant("the model's own decode called",
           SimpleNamespace(decode_step=lambda model, next_idx, cache: model.decode(next_idx, cache)),
           expect="your code called orthros.Orthros.decode"),
]


def cases(**options):
    T = 13
    models = {"attn='orthros'": tiny_model("orthros"), "attn='orthros', conv_kernel=3": tiny_model("orthros", conv_kernel=3),
              "attn='swa'": tiny_model("swa")}
    found = []
    for p in (12, 11, 9, 5, 4, 1):
        for name, model in models.items():
            found.append(Case(
                f"prefill(idx[:, :{p}]), then {T - p} decode_step(s) with the tokens idx[:, {p}:]; idx of shape "
                f"(2, {T}), {name}, w=4, 2 layers",
                inputs=lambda model=model, p=p: dict(model=model, idx=tokens(2, T), p=p),
                call=lambda answer, model, idx, p: decoded(answer, model, idx, p)[0],
                invariant="train == decode: the logits of each decode step equal those of one training forward "
                          "over the whole sequence, at positions p ... T-1",
                atol=1e-10, expected=training_logits, output="your logits of the decode steps"))
    found.append(Case(
        f"the cache after prefill(idx[:, :1]) and {T - 1} decode steps: cache.layers[l].k, .v (and .conv_state) "
        "for each layer, then cache.length; attn='orthros', conv_kernel=3",
        inputs=lambda: dict(model=models["attn='orthros', conv_kernel=3"], idx=tokens(2, T), p=1),
        call=lambda answer, model, idx, p: cache_contents(decoded(answer, model, idx, p)[1]),
        invariant="the cache keeps every position: it equals the cache of prefill(idx) over the whole sequence",
        atol=1e-10, expected=lambda model, idx, p: cache_contents(model.prefill(idx)[1]), output="your cache's tensors"))
    return found


def decoded(answer, model, idx, p):
    """The logits of the student's decode steps after prefill(idx[:, :p]) (a list, one (B, 1, vocab)
    per step), and the final cache."""
    _, cache = model.prefill(idx[:, :p])
    steps = []
    for t in range(p, idx.size(1)):
        logits, cache = answer.decode_step(model, idx[:, t], cache)   # their form is checked on return
        steps.append(logits)
    return steps, cache


def training_logits(model, idx, p):
    with torch.no_grad():
        full = model(idx)[0]
    return [full[:, t:t + 1] for t in range(p, idx.size(1))]


def cache_contents(cache):
    contents = []
    for layer in cache.layers:
        contents += [layer.k, layer.v] + ([layer.conv_state] if getattr(layer, "conv_state", None) is not None else [])
    return contents + [cache.length]
