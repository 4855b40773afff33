"""Exercise 6, how far each stream can see: the checker, hints and known bugs."""

from types import SimpleNamespace

import torch

from exercises.framework import Bug, Case, Mutant, tiny_model, tokens, variant
from exercises.solutions import ex06_reach as solution

TITLE = "How far each stream can see"
DIFFICULTY = 3
MINUTES = 30
TEACHES = "measured by perturbing inputs: SWA's reach is exactly [t - L(w-1), t]; Orthros's output stream sees every earlier position"
FUNCTIONS = ("positions_that_change", "swa_reach")
REFERENCE = SimpleNamespace(positions_that_change=solution.positions_that_change, swa_reach=solution.swa_reach)
RETURNS = {"positions_that_change": "positions", "swa_reach": "reach"}

HINTS = [
    "Run the model once and keep the logits at position t. Then, for each position j, change one token "
    "(the others stay), run again, and ask whether the logits at t moved at all. A window of w keys covers "
    "the w-1 positions before t plus t itself: one layer reaches w-1 back; L layers chain L such hops.",
    "positions_that_change:\n"
    "  before = the logits at t of the unchanged input (model(idx)[0] is (1, T, vocab): take column t)\n"
    "  for each position j: a copy of idx with token j replaced by another token; its logits at t; keep j "
    "if they are not exactly equal to before (compare with torch.equal, not allclose: after several layers "
    "the far influence is tiny, but it is not zero)\n"
    "  never change idx itself: the checker hands you its input and checks that it comes back unchanged\n"
    "swa_reach: how far back one layer reaches, times the number of layers.",
    "Paper, eq. 4: o_t sums over j = max(1, t-w+1) ... t, so one layer sees w-1 positions back; eq. 5: the "
    "output tokens' o'_t sums over j = 1 ... t. Section 3.1: sliding window attention 'to efficiently "
    "assimilate local context', full cross-attention 'to retrieve global information'.",
]


# -- Known bugs ---------------------------------------------------------------------------------

def make_positions(last=False, skip_t=False):
    def positions_that_change(model, idx, t):
        read = -1 if last else t                                     # last: the logits at T-1, not t
        with torch.no_grad():
            before = model(idx)[0][:, read]
            changed = []
            for j in range(t if skip_t else idx.size(1)):            # skip_t: never tries j = t
                other = idx.clone()
                other[0, j] = (other[0, j] + 1) % model.config.vocab_size
                if not torch.equal(model(other)[0][:, read], before):
                    changed.append(j)
        return changed
    return positions_that_change


BUGS = [
    Bug("reach L*w", "a window of w keys holds position t itself and only w-1 earlier ones: one layer reaches "
        "w-1 back, L layers L(w-1).", variant(REFERENCE, swa_reach=lambda n_layer, window: n_layer * window)),
    Bug("position t itself left out", "the token at t is its own key (k_pos <= q_pos): it always changes the "
        "logits at t.", variant(REFERENCE, positions_that_change=make_positions(skip_t=True))),
    Bug("the logits at the last position, not at t", "model(idx)[0][:, t] is the prediction at t; the last "
        "position also sees the tokens after t.", variant(REFERENCE, positions_that_change=make_positions(last=True))),
]


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

MUTANTS = [
    Mutant("the checker's measurement imported",
           source="def positions_that_change(model, idx, t):\n"
                  "    from exercises.solutions.ex06_reach import positions_that_change\n"
                  "    return positions_that_change(model, idx, t)\n\n\n"
                  "def swa_reach(n_layer, window):\n"
                  "    from exercises.checks.ex06_reach import measured_reach\n"
                  "    return measured_reach(n_layer, window)\n",
           expect="is not available to your code"),
]


def cases(**options):
    found = []
    for attn, n_layer, window, T, t in [("swa", 1, 2, 8, 7), ("swa", 1, 3, 8, 5), ("swa", 2, 3, 12, 11),
                                        ("swa", 3, 4, 16, 12), ("orthros", 1, 2, 8, 7), ("orthros", 2, 3, 12, 8),
                                        ("transformer", 2, 3, 10, 9)]:
        model = tiny_model(attn, n_layer=n_layer, window=window)
        found.append(Case(
            f"positions_that_change(model, idx, t={t}): attn={attn!r}, {n_layer} layer(s), w={window}, idx of shape (1, {T})",
            inputs=lambda model=model, T=T, t=t: dict(model=model, idx=tokens(1, T, seed=T), t=t),
            call=lambda answer, model, idx, t: answer.positions_that_change(model, idx, t),
            invariant="the positions whose token moves the logits at t: for SWA exactly t - L(w-1) ... t; for "
                      "Orthros (the output stream) and the Transformer every position 0 ... t; never one after t"))
    for n_layer, window in [(1, 1), (1, 2), (2, 2), (1, 4), (2, 3), (3, 4), (2, 8)]:
        found.append(Case(
            f"swa_reach(n_layer={n_layer}, window={window})",
            inputs=lambda n_layer=n_layer, window=window: dict(n_layer=n_layer, window=window),
            call=lambda answer, n_layer, window: answer.swa_reach(n_layer, window),
            invariant="t minus the farthest position that moves a sliding-window model's logits at t, measured "
                      "live with the stored solution's positions_that_change",
            expected=measured_reach))
    return found


def measured_reach(n_layer, window):
    T = n_layer * (window - 1) + 3  # room for the whole reach and two positions beyond it
    model = tiny_model("swa", n_layer=n_layer, window=window)
    return T - 1 - min(solution.positions_that_change(model, tokens(1, T, seed=T), T - 1))


def after_pass(answer, **options):
    lines = ["What your functions measure, 2 layers, w = 4, T = 16, at t = 15:"]
    for attn in ("swa", "orthros", "transformer"):
        seen = answer.positions_that_change(tiny_model(attn, n_layer=2, window=4), tokens(1, 16), 15)
        lines.append(f"  {attn:>11}: " + "".join("#" if j in seen else "." for j in range(16)) + f"   ({len(seen)} positions)")
    lines.append(f"  swa_reach(2, 4) = {answer.swa_reach(2, 4)}: SWA sees back to position {15 - answer.swa_reach(2, 4)}")
    return "\n".join(lines)
