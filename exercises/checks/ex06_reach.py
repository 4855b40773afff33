"""Exercise 6, how far each stream can see: the checker."""

import functools

import torch

from exercises.framework import ZOO, Bug, Case, Mutant, change, describe, short, tiny_model, tokens
from exercises.solutions import ex06_reach as solution

TITLE, DIFFICULTY, MINUTES = "How far each stream can see", 3, 30
FUNCTIONS = ("positions_that_change", "swa_reach")
REFERENCE = solution   # the stored solution: its functions
PAPER = "swa_reach(n_layer=12, window=128)"

HINTS = [
    "Run the model once and keep the logits at position t. Then, for each position j, change one token (the others "
    "stay), run again, and ask whether the logits at t moved at all. A window of w keys covers the w-1 positions "
    "before t plus t itself: one layer reaches w-1 back; L layers chain L such hops.",
    "positions_that_change:\n"
    "  before = the logits at t of the unchanged input (model(idx)[0] is (1, T, vocab): take column t)\n"
    "  for each position j: a copy of idx with token j replaced by another token; its logits at t; keep j if they are "
    "not exactly equal to before (compare with torch.equal, not allclose, in the model's own dtype: after several "
    "layers the far influence is tiny, but it is not zero)\n"
    "  never change idx itself: the checker hands you its input and checks that it comes back unchanged\n"
    "swa_reach: how far back one layer reaches, times the number of layers.",
    "Paper, eq. 4: o_t sums over j = max(1, t-w+1) ... t, so one layer sees w-1 positions back; eq. 5: the output "
    "tokens' o'_t sums over j = 1 ... t. Section 3.1: sliding window attention 'to efficiently assimilate local "
    "context', full cross-attention 'to retrieve global information'.",
]

AFTER = "model(other)[0][:, t]"
COMPARED = f"if not torch.equal({AFTER}, before):"
PERTURBED = "(other[0, j] + 1) % model.config.vocab_size"
REACH = "n_layer * (window - 1)"
BUGS = [
    Bug("reach L*w", "a window of w keys holds position t itself and only w-1 earlier ones: one layer reaches w-1 back, "
        "L layers L(w-1).", {REACH: "n_layer * window"}),
    Bug("position t itself left out", "the token at t is its own key (k_pos <= q_pos): it always changes the logits at t.",
        {"for j in range(idx.size(1)):": "for j in range(t):"}),
    Bug("the logits at the last position, not at t", "model(idx)[0][:, t] is the prediction at t; the last position also "
        "sees the tokens after t.", {"before = model(idx)[0][:, t]": "before = model(idx)[0][:, -1]", AFTER: "model(other)[0][:, -1]"}),
]
MUTANTS = [
    Mutant("a random other token, from a seeded generator (the draw can repeat the token)", "position 7 is missing", {PERTURBED:
           "torch.randint(0, model.config.vocab_size, (), generator=g)", "changed = []": "changed, g = [], torch.Generator().manual_seed(16)"}),
    Mutant("the token set to 0, not changed", "position 6 is missing", {PERTURBED: "0"}),
    Mutant("token + 1 without the modulo", "IndexError", {PERTURBED: "other[0, j] + 1"}),
    Mutant("the tiny model's vocabulary hard-coded (% 37)", "IndexError", {PERTURBED: "(other[0, j] + 1) % 37"}),
    Mutant("torch.allclose, not torch.equal", "a faint change, but not zero", {COMPARED: f"if not torch.allclose({AFTER}, before):"}),
    Mutant("the logits compared after .float()", "below float32's resolution",
           {COMPARED: f"if not torch.equal({AFTER}.float(), before.float()):"}),
    Mutant("the predicted token compared, not the logits", "is missing",
           {COMPARED: f"if not torch.equal({AFTER}.argmax(-1), before.argmax(-1)):"}),
    Mutant("the positions from the config, not measured", "position 5 is missing",
           {"    with torch.no_grad():\n        before": "    c = model.config\n    first = 0 if c.attn != 'swa' else "
            "max(0, t - c.n_layer * (c.window - 1))\n    return list(range(first, t + 1))\n    with torch.no_grad():\n        before"}),
    Mutant("idx perturbed in place", "changed its input `idx`", {"other = idx.clone()": "other = idx"}),
    Mutant("the model made float64 for exact comparisons", "changed its input `model`",
           {"    with torch.no_grad():\n        before": "    model.double()\n    with torch.no_grad():\n        before"}),
    Mutant("swa_reach with the window hard-coded", "as window goes from 2 to 3", {REACH: "n_layer * 3"}),
    Mutant("swa_reach as n_layer * window - 1", "yours 3, the reference 2", {REACH: "n_layer * window - 1"}),
    Mutant("swa_reach one too far", "off by one", {REACH: "n_layer * (window - 1) + 1"}),
    Mutant("the checker's measurement imported", "is not available to your code",
           {"    return n_layer * (window": "    from exercises.checks.ex06_reach import measured_reach\n"
                                         "    return measured_reach(n_layer, window)\n    return n_layer * (window"}),
    Mutant("the stored solution imported at the top", "does not import: ImportError",
           source="from exercises.solutions.ex06_reach import positions_that_change, swa_reach\n"),
]
# (attn, n_layer, window, T, t, what else): every dimension an answer could hard-code varies: the depth and the window
# (one not dividing T), the vocabulary (token vocab_size - 1 is planted at t, token 0 at t - 1: a perturbation must
# change both), heads, rope_base, seed, float32, the convolution, t = 0, influences faint enough that only float64 sees them
POSITIONS = [
    ("swa", 1, 2, 8, 7, {}), ("swa", 1, 3, 8, 5, dict(vocab_size=11, seed=1)), ("orthros", 1, 2, 8, 7, {}),
    ("orthros", 3, 2, 9, 0, {}), ("transformer", 2, 3, 10, 9, {}), ("swa", 3, 2, 10, 9, dict(faint=0.01)),
    ("swa", 3, 2, 10, 9, dict(faint=1e-4)), ("swa", 2, 3, 12, 11, dict(n_head=4, rope_base=500.0)),
    ("orthros", 2, 3, 12, 8, dict(dtype=torch.float32, seed=2)), ("swa", 2, 3, 14, 13, dict(conv_kernel=3)),
    ("swa", 3, 4, 16, 12, dict(n_head=4, dtype=torch.float32, seed=3)),
    *(("orthros", 2, 2, 8, 6, dict(more, dtype=dtype)) for _, more, dtype in ZOO)]
FAINT = "; far positions move the logits at t only faintly here: a faint change, but not zero, is a change"
FAINTER = "; far positions move the logits at t below float32's resolution here: compare in the model's own dtype"
# (n_layer, window): first (2, 2), where the bug L*w (4) fails unlike L*w - 1 or L(w-1) + 1 (3); last, the paper's
REACHES = [(2, 2), (1, 1), (1, 2), (3, 2), (1, 4), (2, 3), (3, 4), (2, 8), (4, 5), (12, 128)]
INVARIANT = ("the positions whose token moves the logits at t: for SWA exactly t - L(w-1) ... t (a convolution of kernel k "
             "reaches k-1 further per layer); for Orthros (the output stream) and the Transformer every position 0 ... t; "
             "never one after t")


def cases(**options):
    yield Case("swa_reach(1, 3) - swa_reach(1, 2): how the reach changes as window goes from 2 to 3", dict(args=(1, 2),
               changed=(1, 3)), lambda answer, args, changed: change(answer.swa_reach(*args), answer.swa_reach(*changed)),
               "the measured reach's change: a window one larger reaches one further per layer",
               expected=lambda args, changed: measured_reach(*changed) - measured_reach(*args), output="your reach's change")
    yield from [Case(f"swa_reach(n_layer={n_layer}, window={window})" + (" (the paper's)" if window == 128 else ""),
                     dict(n_layer=n_layer, window=window), "swa_reach", "t minus the farthest position that moves a "
                     "sliding-window model's logits at t, measured live", expected=measured_reach, output="your reach")
                for n_layer, window in REACHES]
    for attn, n_layer, window, T, t, more in POSITIONS:
        more = dict(more)
        dtype, faint, seed = more.pop("dtype", None), more.pop("faint", None), more.pop("seed", 0)
        model = tiny_model(attn, seed=seed, n_layer=n_layer, window=window, **more)
        with torch.no_grad():
            for block in model.blocks if faint else []:
                block.attn.c_proj.weight.mul_(faint)
        vocab = model.config.vocab_size
        idx = tokens(1, T, vocab=vocab, seed=T + seed)
        idx[0, max(t - 1, 0)], idx[0, t] = 0, vocab - 1
        details = ", ".join([f"{n_layer} layer(s)", f"n_head={model.config.n_head}", f"w={window}", f"vocab_size={vocab}"] +
                            [f"{k}={v!r}" for k, v in more.items() if k not in ("n_head", "vocab_size")] +
                            ([f"each attention's output projection scaled by {faint}"] if faint else []))
        planted = (f"token 0 at position {t - 1}, " if t else "") + f"token {vocab - 1} (= vocab_size - 1) at position {t}"
        yield Case(f"positions_that_change(model, idx, t={t}): attn={attn!r}, {details}; idx of shape (1, {T}) with {planted}",
                   dict(model=model, idx=idx, t=t), "positions_that_change", INVARIANT + (FAINT if faint == 0.01 else
                   FAINTER if faint else ""), compare=compared, dtype=dtype, output="your positions")


def compared(mine, right):
    """What is wrong with a list of positions, in words: the first one missing or too many."""
    if not isinstance(mine, list) or not all(type(j) is int for j in mine):
        return f"your positions are {describe(mine)}, expected a list of ints"
    wrong = sorted(set(mine) ^ set(right))
    if not wrong:
        return None if mine == right else f"yours {short(mine)}: the right positions, but not once each in order"
    return f"yours {short(mine)}, measured {short(right)}: position {wrong[0]} is " + \
        ("missing" if wrong[0] in right else "in yours, though changing its token leaves the logits at t as they were")


@functools.lru_cache(maxsize=None)
def measured_reach(n_layer, window):
    """t minus the farthest position that moves the logits at t = T - 1 of a tiny SWA model, measured live: the gradient
    of those logits with respect to each position's embedding is exactly zero beyond the reach (perturbing tokens, as
    the exercise does, loses the farthest influences of deep models to float64's rounding: about (1/w)^L)."""
    T = n_layer * (window - 1) + 3   # room for the whole reach and two positions beyond it
    model, kept = tiny_model("swa", n_layer=n_layer, window=window, n_embd=8, n_head=1, max_seq_len=max(512, T)), []
    model.wte.register_forward_hook(lambda module, args, out: kept.append(out))
    grad, = torch.autograd.grad(model(tokens(1, T, seed=T))[0][0, T - 1].sum(), kept)
    return T - 1 - int((grad[0] != 0).any(-1).nonzero().min())
