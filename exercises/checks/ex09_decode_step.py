"""Exercise 9, the KV-cache decode step: the checker, hints and known bugs."""

from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, forbidden, tiny_model, tokens
from exercises.solutions import ex09_decode_step as solution
from orthros import Orthros, rope_cos_sin

TITLE = "The KV-cache decode step"
DIFFICULTY = 4
MINUTES = 40
TEACHES = "decode = a forward with T = 1, t_out = 1 over the cache; train == prefill + decode; the cache keeps every position"
FUNCTIONS = ("decode_step",)
REFERENCE = SimpleNamespace(decode_step=solution.decode_step)

HINTS = [
    "Decoding is the same forward pass with T = 1 and t_out = 1: one base token and (for Orthros) one "
    "output token, both at the new position S = cache.length. Each block gets its layer's cached keys "
    "and values as `past` and returns them with the new token's appended: store them back, so the next "
    "step sees this token. Then advance cache.length and read the logits from the output twin.",
    "x = model.wte(next_idx.reshape(-1, 1))            (B, 1, C)\n"
    "z = cat([x, x], dim=1) for Orthros, x for the baselines\n"
    "rope = rope_cos_sin(torch.tensor([S] * z.size(1)), C // n_head, rope_base, dtype)   S = cache.length\n"
    "for l, block: z, present = block(z, 1, rope, (cache.k[l], cache.v[l], cache.conv[l])); "
    "cache.k[l], cache.v[l], cache.conv[l] = present\n"
    "cache.length += 1;  logits = model.lm_head(model.ln_f(z[:, -1:]))",
    "Paper, section 3.2, Decoding (T_in = 0, T_out = 1): 'each step processes exactly one generated token "
    "(T = 1). This single token is duplicated to form the decoupled pair: the base token updates the KV cache "
    "and computes sliding window attention, while the output-specific token performs full cross-attention "
    "against the historical cache'. In orthros.py: Orthros.decode and Orthros._forward with a cache.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(no_append=False, position_shift=0, keep_window=False):
    def decode_step(model, next_idx, cache):
        x = model.wte(next_idx.reshape(-1, 1))
        z = torch.cat([x, x], dim=1) if model.config.attn == "orthros" else x
        position = torch.tensor([cache.length + position_shift] * z.size(1))
        rope = rope_cos_sin(position, model.config.n_embd // model.config.n_head, model.config.rope_base,
                            model.wte.weight.dtype)
        with torch.no_grad():
            for l, block in enumerate(model.blocks):
                z, (k, v, conv) = block(z, 1, rope, (cache.k[l], cache.v[l], cache.conv[l]))
                if keep_window:  # an SWA cache: only the last w positions
                    k, v = k[:, :, -model.config.window:], v[:, :, -model.config.window:]
                if not no_append:
                    cache.k[l], cache.v[l], cache.conv[l] = k, v, conv
            cache.length += 1
            return model.lm_head(model.ln_f(z[:, -1:])), cache
    return SimpleNamespace(decode_step=decode_step)


BUGS = [
    Bug("the new keys and values not appended to the cache", "the block returns the cache with the new token's "
        "keys and values (present): store it, or the next step never sees this token.", make_bug(no_append=True)),
    Bug("the RoPE position off by one", "the new token sits at position S = cache.length (the prompt filled "
        "0 ... S-1), not S + 1.", make_bug(position_shift=1)),
    Bug("a sliding-window cache (only the last w positions kept)", "right for SWA, wrong for Orthros: the "
        "output tokens attend every position, so the cache must keep them all.", make_bug(keep_window=True)),
]


def cases(**options):
    T = 13
    idx = tokens(2, T)
    models = {"attn='orthros'": tiny_model("orthros"), "attn='orthros', conv_kernel=3": tiny_model("orthros", conv_kernel=3),
              "attn='swa'": tiny_model("swa")}
    full = {name: model(idx)[0].detach() for name, model in models.items()}
    found = []
    for p in (12, 11, 9, 5, 4, 1):
        for name, model in models.items():
            found.append(Case(
                f"prefill(idx[:, :{p}]), then {T - p} decode_step(s) with the tokens idx[:, {p}:]; idx of shape "
                f"(2, {T}), {name}, w=4, 2 layers",
                lambda impl, model=model, p=p: decoded_logits(impl, model, idx, p)[0],
                "train == decode: the logits of prefill and each decode step equal those of one training forward "
                "over the whole sequence at positions p-1 ... T-1", atol=1e-10,
                expected=lambda name=name, p=p: full[name][:, p - 1:]))
    model = models["attn='orthros'"]
    found.append(Case(
        f"the cache after prefill(idx[:, :1]) and {T - 1} decode steps: [cache.k[l], cache.v[l] for each layer], "
        "cache.length; attn='orthros'",
        lambda impl: cache_contents(decoded_logits(impl, model, idx, 1)[1]),
        "the cache keeps every position: it equals the cache of prefill(idx) over the whole sequence", atol=1e-10,
        expected=lambda: cache_contents(model.prefill(idx)[1])))
    return found


def decoded_logits(impl, model, idx, p):
    """Logits at positions p-1 ... T-1: prefill(p tokens), then the student's decode steps."""
    logits, cache = model.prefill(idx[:, :p])
    out = [logits]
    with forbidden(Orthros, "decode", "_forward", "forward", why="this exercise asks you to write: use its blocks"):
        for t in range(p, idx.size(1)):
            logits, cache = impl.decode_step(model, idx[:, t], cache)
            out.append(logits)
    return torch.cat(out, dim=1), cache


def cache_contents(cache):
    return [t for layer in range(len(cache.k)) for t in (cache.k[layer], cache.v[layer])] + [cache.length]
