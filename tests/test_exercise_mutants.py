"""
The exercise checkers, proven by the wrong answers they reject (issue 17) and the right answers
they accept:

1. The mutation score per exercise, printed: every mutant of the checks module (a realistic wrong
   answer that is not on the exercise's known-bug list) fails, saying why; at least five per
   exercise, at least one of them a shortcut (a refused call or import), none of them failing the
   way a known bug does (then it would be that bug, not a mistake of its own). Exercise 10's
   mutants fail on its made-up runs, before it would wait for trained ones.
2. Issue 18's two answers to exercise 1, the distance in int8 and the distance clamped at 100,
   fail at the paper's window (T = 300, w = 128), saying which distances they get wrong.
3. Each checker has a case at the paper's sizes (w = 128 and T >= 300 for what is shaped by the
   window, T = 2048 for exercise 3; 12 layers, n_embd 768, 6 heads, vocab 50304 where FLOPs or
   shapes are counted).
4. A right answer written differently from the reference passes (the checker is not tuned to the
   reference's way of writing it).

tests/test_exercises.py checks the known bugs, the stubs and the framework itself.
Run: python -m pytest -q tests/test_exercise_mutants.py
"""

import pytest

from exercises import framework
from exercises.framework import load_spec

EXERCISES = range(1, 11)
SHORTCUT = ("refuses", "is not available to your code")   # a refused call, a refused import


@pytest.mark.parametrize("n", EXERCISES)
def test_mutation_score(n, capsys):
    """Every mutant fails, saying why; the score is printed, e.g. "exercise 1: 9 of 9 mutants caught"."""
    spec = load_spec(n)
    results = [(mutant, framework.check(spec, mutant)) for mutant in spec.MUTANTS]
    caught = [m for m, r in results if r.status == "FAIL" and m.expect in r.message]
    shortcuts = [m for m, r in results if any(words in r.message for words in SHORTCUT)]
    with capsys.disabled():
        print(f"\nexercise {n}: {len(caught)} of {len(results)} mutants caught (FAIL, saying why); "
              f"{len(shortcuts)} of them shortcuts")
    missed = [f"{m.name}: {r.status}, expected {m.expect!r} in:\n{r.message}" for m, r in results if m not in caught]
    assert not missed, "\n\n".join(missed)
    assert len(results) >= 5 and shortcuts, "at least five mutants, at least one a shortcut"
    assert not {bug.name for bug in spec.BUGS} & {m.name for m in spec.MUTANTS}
    assert not [(m.name, r.named) for m, r in results if r.named], "a mutant that fails as a known bug does is that bug"


@pytest.mark.parametrize("distance, wrong", [("(q_pos - k_pos).to(torch.int8)", "30272 of 90000 entries differ"),
                                             ("(q_pos - k_pos).clamp(max=100)", "14878 of 90000 entries differ")])
def test_small_or_clamped_distances_fail_at_the_papers_window(distance, wrong):
    """Issue 18: both answers passed the small windows; they fail at T = 300, w = 128, naming the distances."""
    source = ("import torch\n\n\ndef in_window(q_pos, k_pos, window):\n"
              f"    d = {distance}\n    causal = k_pos <= q_pos\n"
              "    return causal if window is None else causal & (d < window)\n\n\n"
              "def attention_mask(n_q, n_k, window=None, device=None):\n"
              "    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]\n"
              "    return in_window(q_pos, torch.arange(n_k, device=device)[None, :], window)\n")
    spec = load_spec(1)
    result = framework.check(spec, framework.load_answer(spec, source, "/nowhere/ex01_distance.py"))
    assert result.status == "FAIL" and wrong in result.message, result.message
    case = result.message.splitlines()[1]
    assert "window=128" in case and "T=300" in case, result.message
    assert "distances" in result.message and "int8" in result.message and "clamped" in result.message


PAPER = {1: ("window=128", "300"), 2: ("w=128", "300"), 3: ("2048",), 4: ("w=128", "T=300"), 5: ("window=128", "300"),
         6: ("n_layer=12", "window=128"), 7: ("T=300", "12 x 768, 6 heads, w=128, V=50304"),
         8: ("window=128", "300"), 9: ("12 layers, n_embd 768, 6 heads, vocab_size 50304, w=128", "300"),
         10: ("w=128, 12 layers",)}


@pytest.mark.parametrize("n", EXERCISES)
def test_a_case_at_the_papers_sizes(n):
    """Issue 18: each checker runs a case at the paper's sizes."""
    assert any(all(words in case.what for words in PAPER[n]) for case in load_spec(n).cases()), n


RIGHT = {
    1: "import torch\n\n\ndef in_window(q_pos, k_pos, window):\n    seen = torch.le(k_pos, q_pos)\n"
       "    if window:\n        seen = torch.logical_and(seen, k_pos > q_pos - window)\n    return seen\n\n\n"
       "def attention_mask(n_q, n_k, window=None, device=None):\n"
       "    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)\n"
       "    return mask if window is None else mask.triu(n_k - n_q - window + 1)\n",
    2: "import torch\n\nfrom orthros import rope_cos_sin\n\n\ndef two_stream_logits(model, idx, t_out):\n"
       "    B, T = idx.shape\n    x = model.drop(model.wte(idx))\n    z = torch.cat([x, x[:, -t_out:]], dim=1)\n"
       "    positions = torch.arange(T, device=idx.device)\n    positions = torch.cat([positions, positions[-t_out:]])\n"
       "    cos, sin = rope_cos_sin(positions, model.blocks[0].attn.head_dim, model.config.rope_base)\n"
       "    rope = cos.to(model.lm_head.weight.dtype), sin.to(model.lm_head.weight.dtype)\n"
       "    for block in model.blocks:\n        z = block(z, T, rope)\n    return model.lm_head(model.ln_f(z))[:, T:]\n",
    3: "import torch\n\n\ndef smallest_t_out(targets):\n    rows, columns = torch.where(targets >= 0)\n"
       "    return targets.shape[-1] - columns.min().item() if len(columns) else 1\n\n\n"
       "def tokens_through_layers(attn, T, t_out):\n    return {'orthros': T + t_out}.get(attn, T)\n",
    4: "import math\n\nimport torch\n\nfrom orthros import apply_rope, attention_mask\n\n\n"
       "def orthros_attention(attn, z, T, cos, sin):\n    B, L, C = z.shape\n    D = cos.size(-1)\n    H = C // D\n"
       "    heads = lambda t: t.reshape(B, t.size(1), H, D).permute(0, 2, 1, 3)\n"
       "    q = apply_rope(heads(attn.alpha * attn.c_q(z[:, :T]) + attn.beta), cos[:T], sin[:T])\n"
       "    q_out = apply_rope(heads(attn.alpha_out * attn.c_q(z[:, T:]) + attn.beta_out), cos[T:], sin[T:])\n"
       "    k, v = apply_rope(heads(attn.c_k(z[:, :T])), cos[:T], sin[:T]), heads(attn.c_v(z[:, :T]))\n"
       "    q = torch.cat([q, q_out], dim=2)\n"
       "    mask = torch.cat([attention_mask(T, T, attn.window, z.device), attention_mask(L - T, T, None, z.device)])\n"
       "    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float('-inf'))\n"
       "    y = scores.softmax(dim=-1) @ v\n    return attn.c_proj(y.permute(0, 2, 1, 3).reshape(B, L, C))\n",
    5: "import dataclasses\n\nimport torch\n\nfrom orthros import Orthros\n\n\ndef convert(transformer, window):\n"
       "    model = Orthros(dataclasses.replace(transformer.config, attn='orthros', window=window))\n"
       "    model = model.to(dtype=next(transformer.parameters()).dtype)\n    own = model.state_dict()\n"
       "    with torch.no_grad():\n        for name, weight in transformer.state_dict().items():\n"
       "            own[name].copy_(weight)\n        for name, p in model.named_parameters():\n"
       "            if name.endswith(('alpha', 'alpha_out')):\n                p.fill_(1.0)\n"
       "            elif name.endswith(('beta', 'beta_out')):\n                p.zero_()\n    return model\n",
    6: "import torch\n\n\ndef positions_that_change(model, idx, t):\n    vocab = model.config.vocab_size\n"
       "    with torch.no_grad():\n        logits = lambda tokens: model(tokens)[0][0, t]\n        before = logits(idx)\n"
       "        found = []\n        for j in range(t + 1):                      # nothing after t can matter\n"
       "            other = idx.clone()\n            other[0, j] = (other[0, j] + vocab // 2) % vocab\n"
       "            if (logits(other) != before).any():\n                found.append(j)\n    return found\n\n\n"
       "def swa_reach(n_layer, window):\n    return (window - 1) * n_layer\n",
    7: "def attended_pairs(T, window=None, n_q=None):\n    n_q = T if n_q is None else n_q\n"
       "    return sum(t + 1 if window is None else min(t + 1, window) for t in range(T - n_q, T))\n\n\n"
       "def prefill_flops(cfg, T):\n    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size\n"
       "    outputs = 1 if cfg.attn == 'orthros' else 0\n"
       "    matrices = 2 * C * C * (T + outputs) * 2 + 2 * C * C * T * 2 + 2 * 8 * C * C * (T + outputs)\n"
       "    pairs = attended_pairs(T, None if cfg.attn == 'transformer' else cfg.window)\n"
       "    pairs += attended_pairs(T, None, 1) * outputs\n"
       "    return L * (matrices + 2 * 2 * C * pairs) + 2 * C * V\n",
    8: "import math\n\nimport torch\nimport torch.nn.functional as F\n\n\n"
       "def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):\n    B, H, T, D = q.shape\n"
       "    w, n = window, -(-T // window)\n    rows = n * w\n"
       "    q = torch.cat([q, q.new_zeros(B, H, rows - T, D)], dim=2).reshape(B * H, n, w, D)\n"
       "    pad = lambda x: torch.cat([x.new_zeros(B, H, w, D), x, x.new_zeros(B, H, rows - T, D)], dim=2)\n"
       "    k, v = (pad(x).reshape(B * H, n + 1, w, D) for x in (k, v))\n"
       "    k, v = (torch.cat([x[:, :n], x[:, 1:]], dim=2) for x in (k, v))\n"
       "    i = torch.arange(w, device=q.device)[:, None]\n    j = torch.arange(2 * w, device=q.device)[None, :]\n"
       "    first = torch.arange(n, device=q.device)[:, None, None] * w\n"
       "    seen = (j <= i + w) & (j > i) & (first - w + j >= 0)           # key j of 2w: position b*w - w + j\n"
       "    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float('-inf'))\n"
       "    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + bias, dim=-1)\n"
       "    y = F.dropout(weights, dropout_p) @ v\n    return y.reshape(B, H, rows, D)[:, :, :T]\n",
    9: "import torch\n\nfrom orthros import rope_cos_sin\n\n\ndef decode_step(model, next_idx, cache):\n"
       "    B = next_idx.shape[0]\n    x = model.wte(next_idx.view(B, 1))\n"
       "    rows = 2 if model.config.attn == 'orthros' else 1\n    z = x.expand(B, rows, x.size(-1))\n"
       "    where = torch.tensor([cache.length] * rows, device=next_idx.device)\n"
       "    rope = rope_cos_sin(where, model.blocks[0].attn.head_dim, model.config.rope_base, model.lm_head.weight.dtype)\n"
       "    with torch.no_grad():\n        for l, block in enumerate(model.blocks):\n"
       "            z = block(z, 1, rope, cache.layers[l])\n        cache.length += 1\n"
       "        return model.lm_head(model.ln_f(z))[:, -1:], cache\n",
    10: "import json\nfrom pathlib import Path\n\nfrom checkpoint import load_checkpoint\n\n\ndef recall_summary(run_dir):\n"
        "    config = load_checkpoint(Path(run_dir) / 'ckpt_last.pt')['model_config']\n"
        "    with open(Path(run_dir) / 'exact_match.json') as f:\n        buckets = json.load(f)\n"
        "    w, L = config['window'], config['n_layer']\n    inside, beyond = [0, 0], [0, 0]\n"
        "    for name, r in buckets.items():\n        lo, hi = (int(x) for x in name.split('-'))\n"
        "        for pool, keep in ((inside, hi <= w), (beyond, lo >= L * w)):\n"
        "            if keep:\n                pool[0] += round(r['accuracy'] * r['n'])\n                pool[1] += r['n']\n"
        "    return dict(attn=config['attn'], window=w, n_layer=L, inside=inside[0] / inside[1], beyond=beyond[0] / beyond[1])\n",
}


@pytest.mark.parametrize("n", EXERCISES)
def test_another_right_answer_passes(n, tmp_path):
    """A right answer written otherwise than the reference (tril/triu masks, the attention written out, a copy
    tensor by tensor, another perturbation, the pairs summed row by row, the twins by expand, hits rounded, ...)
    passes: the cases test what the docstring asks, not one way to write it. (Exercise 10 passes its made-up
    runs and then waits for trained ones.)"""
    spec = load_spec(n)
    answer = framework.load_answer(spec, RIGHT[n], f"/nowhere/ex{n:02d}_another.py")
    options = dict(runs={"swa": str(tmp_path / "swa"), "orthros": str(tmp_path / "orthros")}) if n == 10 else {}
    result = framework.check(spec, answer, **options)
    assert result.status == ("waiting" if n == 10 else "PASS"), result.message
