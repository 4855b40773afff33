"""Exercise 9, the KV-cache decode step: the checker."""

import torch

from exercises.framework import ZOO, Bug, Case, Mutant, Wrong, describe, difference, handed_to_blocks, tiny_model, tokens
from exercises.solutions import ex09_decode_step as solution
from orthros import KVCache, Orthros, OrthrosConfig
from perf import engine

TITLE, DIFFICULTY, MINUTES = "The KV-cache decode step", 4, 40
FUNCTIONS = ("decode_step",)
REFERENCE = solution   # the stored solution: its functions
FORBIDDEN = dict.fromkeys((Orthros.forward, Orthros.prefill, Orthros.decode, Orthros.generate, Orthros.generate_tokens,
                           engine.FastDecoder.prefill, engine.FastDecoder.decode, engine.FastDecoder.generate_tokens, engine.layer_in,
                           engine.layer_out), "it runs the forward pass (or the whole decode step) this exercise asks you to "
                          "build from the blocks")
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
    Mutant("rope_base hard-coded (10000)", "rope_base=500000.0", {"model.config.rope_base,": "10000.0,"}),
    Mutant("head_dim from n_layer", "expected (2, 4)", {"// model.config.n_head": "// model.config.n_layer"}),
    Mutant("head_dim from n_kv_head", "expected (2, 4)", {"// model.config.n_head": "// (model.config.n_kv_head or model.config.n_head)"}),
    Mutant("the RoPE scaling left out", "llama3 RoPE scaling", {", model.config.rope_scaling)": ")"}),
    Mutant("the LM head read as the embedding (a tied model's)", "untied head", {LOGITS: "model.ln_f(z[:, -1:]) @ model.wte.weight.T"}),
    Mutant("the position made in the weights' dtype", "past 256", {"S, device=x.device)": "S, device=x.device, dtype=model.wte.weight.dtype)"}),
    Mutant("the RoPE tables kept per position, whatever the device", "the first run's model and sizes again",
           {"\ndef decode_step": "\n_TABLES = {}   # the RoPE tables of each position, made once\n\n\ndef decode_step",
            "    rope = rope_cos_sin(": "    key = (S, z.size(1), repr(model.config), model.wte.weight.dtype)\n"
                                   "    rope = _TABLES[key] if key in _TABLES else _TABLES.setdefault(key, rope_cos_sin(",
            "model.config.rope_scaling)": "model.config.rope_scaling))"}),
    Mutant("an output twin for SWA too", "at ['logits']", {TWINS: "z = torch.cat([x, x], dim=1)"}),
    Mutant("Orthros's output twin left out", "at ['logits']", {TWINS: "z = x"}),
    Mutant("the logits in float64 (.double())", "your logits have dtype torch.float64, expected torch.bfloat16",
           {LOGITS: LOGITS + ".double()"}),
    Mutant("the RoPE tables in float32 whatever the model (rope_cos_sin's default dtype)", "dtype torch.float32, expected "
           "torch.float64", {"model.wte.weight.dtype, model": "scaling=model"}),
    Mutant("the embedding made float32 and back", "about float32's rounding",
           {EMBED: EMBED + ".float().to(model.wte.weight.dtype)   # float32 holds an embedding"}),
    Mutant("next_idx of shape (B, 1) made (B, 1, 1, C)", "next_idx of shape (2, 1)", {EMBED: "x = model.wte(next_idx)[:, None]"}),
    Mutant("next_idx.squeeze() (a 0-d index when B = 1)", "next_idx of shape (1,)",
           {EMBED: "x = model.wte(next_idx.squeeze()).unsqueeze(1)"}),
    Mutant("next_idx unsqueezed on the wrong side", "your code hands block 0 z of", {EMBED: "x = model.wte(next_idx.unsqueeze(0))"}),
    Mutant("both twins handed to the blocks as base tokens", "your code hands block 0 T=2", {BLOCK: "z = block(z, z.size(1), rope, layer_cache)"}),
    Mutant("the convolution's state dropped each step", "conv_state",
           {BLOCK: "layer_cache.conv_state = None   # a fresh start for the new token\n            " + BLOCK}),
    Mutant("cache.length not advanced", "at ['cache.length']: yours 12, the reference 13", {"        cache.length = S + 1\n": ""}),
    Mutant("the positions made on the CPU", "is on cpu, expected meta", {"device=x.device)": "device='cpu')"}),
]
OTHER = dict(n_layer=3, n_head=4, n_embd=24, window=3, rope_base=500.0, dropout=0.1, vocab_size=50, conv_kernel=2,
             seed=1)
MODELS = [   # (name, attn, overrides, dtype): the zoo's members as Orthros models, then the other attentions and options
    *((f"attn='orthros', {name}", "orthros", more, dtype) for name, more, dtype in ZOO),
    ("attn='orthros', conv_kernel=3", "orthros", dict(conv_kernel=3), None), ("attn='swa'", "swa", {}, None),
    ("attn='transformer'", "transformer", {}, None),
    ("attn='orthros', " + ", ".join(f"{k}={v!r}" for k, v in OTHER.items()), "orthros", OTHER, None)]
# (p, models, batch, next_idx as (B, 1), T): the fewest decode steps first (the last model: OTHER); then positions past 256
RUNS = [(12, range(len(MODELS)), 2, False, 13), (12, [0], 2, True, 13), (12, [0], 1, False, 13), (11, [-1], 3, True, 13),
        (4, range(len(MODELS) - 1), 2, False, 13), (1, [0], 2, False, 13), (257, [len(ZOO) - 1], 1, False, 261)]
PAPER_SIZE = dict(n_layer=2, n_embd=768, n_head=6, vocab_size=50304, window=128)   # 2 of its 12 layers: meta is slow
ONE_TOKEN = "one new token per sequence: z is (B, rows, C), its base twin the first row"
INVARIANT = ("train == decode: after the steps the cache (compared first: cache.length, the next token's position, then "
             "each layer's conv_state, keys and values) equals that of prefill(idx) over the whole sequence, and each step's "
             "logits equal the training forward's at its position (the LM head reads Orthros's output twin, z's last row; "
             "the baselines have no twin)")


def cases(**options):
    models = [tiny_model(attn, **{"seed": 0, **more}) for _, attn, more, _ in MODELS]
    for p, which, B, column, T in RUNS:
        for i in which:
            (name, _, _, dtype), c = MODELS[i], models[i].config
            yield Case(f"prefill(idx[:, :{p}]), then {T - p} decode_step(s) with the tokens idx[:, {p}:], each as next_idx "
                       f"of shape {f'({B}, 1)' if column else f'({B},)'}; idx of shape ({B}, {T}), {name}, w={c.window}, "
                       f"{c.n_layer} layers" + (", positions past 256 (bfloat16 holds every integer only up to 256)" if
                       T > 256 else ""), dict(model=models[i], idx=tokens(B, T, seed=B), p=p, column=column), decoded,
                       INVARIANT, expected=trained, dtype=dtype, output="your steps' result")
    with torch.device("meta"):   # the paper's widths on meta: shapes, no values (and no memory)
        paper = Orthros(OrthrosConfig(**PAPER_SIZE)).eval()
    for model, p, about in [(models[0], 12, "the first run's model and sizes again"), (paper, 300, f"2 layers at {PAPER}")]:
        yield Case(f"prefill(idx[:, :{p}]), then a decode_step on the meta device (shapes, no values): {about}, next_idx of "
                   "shape (2,)", lambda model=model, p=p: dict(model=model, idx=torch.zeros(2, p + 1, dtype=torch.long), p=p,
                   column=False), decoded, "the logits (B, 1, vocab) and the cache made where the model is (here: meta; "
                   "nothing made for the CPU fits)", expected=trained, device="meta", output="your steps' result")


def decoded(answer, model, idx, p, column):
    """prefill(idx[:, :p]), then the answer's decode steps over idx[:, p:], what each hands the blocks checked before they
    run: the cache after them, and each step's logits."""
    (B, T), full, (_, cache), steps = idx.shape, model(idx)[0].detach(), model.prefill(idx[:, :p]), []
    for t in range(p, T):
        with handed_to_blocks(model, B, None, 1, ONE_TOKEN, lambda rows, S=cache.length: torch.full((rows,), S)):
            step = answer.decode_step(model, idx[:, t:t + 1] if column else idx[:, t], cache)
        if not isinstance(step, tuple) or len(step) != 2 or not isinstance(step[1], KVCache):
            raise Wrong(f"your decode_step returned {describe(step)}, expected (logits, cache), the cache a KVCache")
        problem = difference(step[0], full[:, t:t + 1], "your logits", values=False)
        if problem:
            raise Wrong(problem)
        steps.append(step[0])
        cache = step[1]
    return contents(cache, steps)


def trained(model, idx, p, column):
    """What the decode steps must give: the cache of prefill(idx), and the training forward's logits at p ... T-1."""
    logits = model(idx)[0].detach()
    return contents(model.prefill(idx)[1], [logits[:, t:t + 1] for t in range(p, idx.size(1))])


def contents(cache, logits):
    layers = {f"cache.layers[{l}].{name}": getattr(layer, name) for l, layer in enumerate(cache.layers)
              for name in ("conv_state", "k", "v") if getattr(layer, name, None) is not None}
    return {"cache.length": cache.length, **layers, "logits": logits}
