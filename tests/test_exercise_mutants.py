"""The checkers, proven by wrong answers a student could write, by class: each fails, its report
naming the property it breaks and the input (its words). A mutant is the stored solution with edits
{old: new} (each old found once)."""

import collections

import pytest

from exercises import framework
from exercises.framework import EXERCISES, load_spec

NO_RUNS = {"runs": {"swa": "/nowhere/swa", "orthros": "/nowhere/orthros"}}   # the recall lab waits
M = collections.namedtuple("M", "n kind name expect edits")
MUTANTS = [
    # Gradients and grad mode: a graph cut, or kept where the reference keeps none
    M(2, "autograd", "the twins' embeddings detached", ["(autograd)", "`model.wte.weight`"],
      {"x[:, T - t_out:]]": "x[:, T - t_out:].detach()]"}),
    M(2, "autograd", "the blocks under torch.no_grad()", ["(autograd)", "gradient"],
      {"    for block in model.blocks:": "    with torch.no_grad():\n        for block in "
       "model.blocks:", "        z = block(z, T, rope)": "            z = block(z, T, rope)"}),
    M(4, "autograd", "the queries detached", ["(autograd)", "the gradient of"],
      {"    if attn.scale_offset:": "    q, q_out = q.detach(), q_out.detach()\n    if "
       "attn.scale_offset:"}),
    M(4, "autograd", "the layer under torch.no_grad()", ["(autograd)"],
      {"    return attn.c_proj(y)": "    with torch.no_grad():\n        return attn.c_proj(y)"}),
    M(5, "autograd", "the converted model frozen", ["(values)", "requires_grad"],
      {"    return model.train(": "    model.requires_grad_(False)\n    return model.train("}),
    M(8, "autograd", "the keys detached", ["(autograd)", "`k`"],
      {"    B, H, T, D = q.shape\n": "    B, H, T, D = q.shape\n    k = k.detach()\n"}),
    M(8, "autograd", "under torch.no_grad()", ["(autograd)"],
      {"    y = sdpa(": "    with torch.no_grad():\n        y = sdpa("}),
    M(9, "autograd", "the step without torch.no_grad()", ["requires_grad"],
      {"    with torch.no_grad():\n": "    if True:\n"}),
    # The caller's inputs changed
    M(1, "inputs", "the distance written into q_pos", ["q_pos"],
      {"    causal = k_pos <= q_pos": "    distance = q_pos\n    distance -= k_pos\n    causal = "
       "k_pos <= q_pos", "(q_pos - k_pos < window)": "(distance < window)"}),
    M(2, "inputs", "the RoPE tables kept on the model", ["(inputs)", "`model.rope` is new"],
      {"    rope = rope_cos_sin(": "    rope = model.rope = rope_cos_sin("}),
    M(3, "inputs", "the targets flagged in place", ["(inputs)", "`targets`"],
      {"(targets != IGNORE)": "targets.ne_(IGNORE)"}),
    M(4, "inputs", "the layer's dropout switched off", ["(inputs)", "`attn.dropout`"],
      {"    B, L, C = z.shape": "    attn.dropout = 0.0\n    B, L, C = z.shape"}),
    M(4, "inputs", "z scaled in place", ["(inputs)"],
      {"    B, L, C = z.shape": "    z *= 1.0\n    B, L, C = z.shape"}),
    M(5, "inputs", "the Transformer put in eval mode", ["(inputs)", "`transformer.training`"],
      {"transformer.state_dict(), strict": "transformer.eval().state_dict(), strict"}),
    M(5, "inputs", "the Transformer's tensors shared", ["(inputs)", "shares memory"],
      {"    model.load_state_dict(transformer.state_dict(), strict=False)": "    for name, p in "
       "transformer.named_parameters():\n        module, _, attr = name.rpartition('.')\n        "
       "setattr(model.get_submodule(module), attr, p)\n    if "
       "transformer.config.tie_embeddings:\n        model.lm_head.weight = model.wte.weight"}),
    M(6, "inputs", "idx perturbed in place", ["(inputs)", "`idx`"],
      {"other = idx.clone()": "other = idx"}),
    M(9, "inputs", "next_idx unsqueezed in place", ["(inputs)", "`next_idx`"],
      {"next_idx.reshape(-1, 1)": "(next_idx.unsqueeze_(1) if next_idx.dim() == 1 else next_idx)"}),
    # The domain's edges: sizes 0 and 1, the window at and past every length, one trained column
    M(1, "edges", "zero queries: positions[-0:]", ["(values)", "n_q=0"],
      {"torch.arange(n_k - n_q, n_k, device=device)[:, None]": "torch.arange(n_k, "
       "device=device)[-n_q:][:, None]"}),
    M(3, "edges", "argmax: column 0 when nothing is trained", ["(values)", "-1, -1"],
      {"    return T - int(columns[0]) if len(columns) else 1": "    return T - int((targets != "
       "IGNORE).any(0).int().argmax())"}),
    M(3, "edges", "one trained column: nonzero().squeeze() is 0-d", ["(crash)", "len()"],
      {".nonzero()": ".nonzero().squeeze()"}),
    M(5, "edges", "a window past max_seq_len capped at it", ["(values)", "window=513"],
      {"window=window)": "window=min(window, transformer.config.max_seq_len))"}),
    M(6, "edges", "position t itself left out", ["(values)", "t=0"],
      {"for j in range(idx.size(1)):": "for j in range(t):"}),
    M(7, "edges", "`n_q or T` reads 0 as all", ["(values)", "n_q=0"],
      {"n_q = T if n_q is None else n_q": "n_q = n_q or T"}),
    M(7, "edges", "the window not clamped to T", ["(values)", "window="],
      {"w = min(window, T)": "w = window"}),
    M(8, "edges", "the window capped at T", ["(values)", "window="],
      {"    w = window\n": "    w = min(window, T)\n"}),
    M(9, "edges", "next_idx.squeeze(): 0-d when B = 1", ["B=1"],
      {"x = model.wte(next_idx.reshape(-1, 1))": "x = model.wte(next_idx.squeeze()).unsqueeze(1)"}),
    M(10, "edges", "inside: hi < window", ["(crash)", "window=2", "ZeroDivisionError"],
      {"hi <= w)": "hi < w)"}),
    # Large magnitudes: what bfloat16 and float32 hold
    M(1, "magnitudes", "the distance in int16", ["(values)", "far=32769"],
      {"(q_pos - k_pos < window)": "((q_pos - k_pos).to(torch.int16) < window)"}),
    M(1, "magnitudes", "window=None as a window of 4096", ["(values)", "window=None"],
      {"causal if window is None else ": "", "< window)": "< (window or 4096))"}),
    M(2, "magnitudes", "positions in the weights' dtype", ["(values)", "T=300", "bfloat16"],
      {"torch.arange(T)\n": "torch.arange(T, dtype=model.wte.weight.dtype)\n"}),
    M(4, "magnitudes", "masked scores filled with -1e4", ["(values)", "scale="],
      {"def orthros_attention(": "def attend(q, k, v, attn_mask):\n    s = q @ k.transpose(-2, "
       "-1) / q.size(-1) ** 0.5\n    return s.masked_fill(~attn_mask, -1e4).softmax(-1) @ "
       "v\n\n\ndef orthros_attention(", "F.scaled_dot_product_attention(q, k, v,": "attend(q, k, "
       "v,", "F.scaled_dot_product_attention(q_out, k, v,": "attend(q_out, k, v,"}),
    M(7, "magnitudes", "pairs summed in float32", ["(values)", "T=32768"],
      {"        return n_q * T - n_q * (n_q - 1) // 2": "        return int(__import__('torch').a"
       "range(T - n_q + 1, T + 1, dtype=__import__('torch').float32).sum())"}),
    M(8, "magnitudes", "the softmax without subtracting each row's max", ["(values)", "scale="],
      {"    y = sdpa(q, k, v, mask, dropout_p=dropout_p)": "    e = (q @ k.transpose(-2, -1) / "
       "math.sqrt(D)).exp() * mask\n    y = F.dropout(e / e.sum(-1, keepdim=True), dropout_p) @ v"
       }),
    M(8, "magnitudes", "masked scores filled with -1e9", ["(values)", "scale=1000000000000000.0"],
      {"    y = sdpa(q, k, v, mask, dropout_p=dropout_p)": "    s = (q @ k.transpose(-2, -1) / "
       "math.sqrt(D)).masked_fill(~mask, -1e9)\n    y = F.dropout(s.softmax(-1), dropout_p) @ v"}),
    M(9, "magnitudes", "the position in the weights' dtype", ["p=257", "bfloat16"],
      {"S, device=x.device)": "S, device=x.device, dtype=model.wte.weight.dtype)"}),
    M(10, "magnitudes", "hits truncated by int()", ["(values)"],
      {'r["accuracy"] * r["n"] for r': 'int(r["accuracy"] * r["n"]) for r'}),
    # State across calls
    M(1, "state", "attention_mask cached by functools.lru_cache",
      ["(repeats)", "changed its first output"],
      {"def attention_mask(": "@__import__('functools').lru_cache(None)\ndef attention_mask("}),
    M(5, "state", "convert cached by functools.lru_cache", ["(repeats)"],
      {"def convert(": "@__import__('functools').lru_cache(None)\ndef convert("}),
    M(6, "state", "the perturbations pile up", ["(values)"],
      {"        for j in range(idx.size(1)):\n            other = idx.clone()\n": "        other "
       "= idx.clone()\n        for j in range(idx.size(1)):\n"}),
    M(6, "state", "the baseline cached by length", ["your positions_that_change differs"],
      {"        before = model(idx)[0][:, t]": "        before = BASE.setdefault((idx.size(1), "
       "t), model(idx)[0][:, t])", "def positions_that_change(": "BASE = {}\n\n\ndef "
       "positions_that_change("}),
    M(8, "state", "the band mask kept per size, whatever the device", ["(crash)", "meta"],
      {"    mask = in_window(": "    mask = BANDS.setdefault((n_blocks, w), in_window(", "(k_pos "
       ">= 0)  ": "(k_pos >= 0))", "\ndef blocked_": "\nBANDS = {}\n\n\ndef blocked_"}),
    M(9, "state", "the RoPE tables kept per position, whatever the device",
      ["(crash)", "broadcast"],
      {"    rope = rope_cos_sin(": "    key = (S, z.size(1), model.wte.weight.dtype)\n    rope = "
       "TABLES[key] if key in TABLES else TABLES.setdefault(key, rope_cos_sin(", "model.config.ro"
       "pe_scaling)": "model.config.rope_scaling))", "\ndef decode_step": "\nTABLES = {}\n\n\ndef"
       " decode_step"}),
    M(10, "state", "recall_summary cached by functools.lru_cache", ["(repeats)"],
      {"def recall_summary(": "@__import__('functools').lru_cache(None)\ndef recall_summary("}),
    M(10, "state", "the config kept per folder", ["(repeats)"],
      {'    config = load_checkpoint(run_dir / "ckpt_last.pt")["model_config"]': "    config = "
       "CONFIGS.setdefault(str(run_dir), load_checkpoint(run_dir / "
       '"ckpt_last.pt")["model_config"])', "\ndef recall_summary": "\nCONFIGS = {}\n\n\ndef "
       "recall_summary"}),
    # Python, not torch
    M(1, "python", "`and` for `&`", ["(crash)", "ambiguous"],
      {"causal & (q_pos - k_pos < window)": "causal and (q_pos - k_pos < window)"}),
    M(3, "python", '`attn is "orthros"`', ["(values)", "attn='orthros'"],
      {'if attn == "orthros"': 'if attn is "orthros"'}),
    M(7, "python", '`cfg.attn is "orthros"`', ["(values)", "attn='orthros'"],
      {'T + 1 if cfg.attn == "orthros"': 'T + 1 if cfg.attn is "orthros"'}),
    M(9, "python", '`model.config.attn is "orthros"`', ["(values)"],
      {'orthros = model.config.attn == "orthros"': 'orthros = model.config.attn is "orthros"'}),
    M(10, "python", '`run_dir + "/ckpt_last.pt"`', ["(crash)", "PosixPath"],
      {'    run_dir = Path(run_dir)\n    config = load_checkpoint(run_dir / "ckpt_last.pt")':
       '    config = load_checkpoint(run_dir + "/ckpt_last.pt")', "json.loads((run_dir / "
       '"exact_match.json").read_text())': 'json.loads(open(run_dir + "/exact_match.json").read()'
       ")"}),
    # Crashes: a FAIL naming the input
    M(2, "crash", "head_dim from n_kv_head", ["(crash)", "TypeError"],
      {"// model.config.n_head": "// model.config.n_kv_head"}),
    M(5, "crash", "the scale-offsets filled whatever the config", ["(crash)", "scale_offset=False"],
      {" if block.attn.scale_offset)": ")"}),
    M(6, "crash", "token + 1 without the modulo", ["(crash)", "IndexError", "t="],
      {"(other[0, j] + 1) % model.config.vocab_size": "other[0, j] + 1"}),
    M(7, "crash", "a recursion as deep as T", ["(crash)", "RecursionError", "T="],
      {"    n_q = T if n_q is None else n_q\n": "    if window is not None and T > 0:   # the "
       "last query sees min(T, w) keys\n        return min(T, window) + attended_pairs(T - 1, "
       "window)\n    n_q = T if n_q is None else n_q\n"}),
    # Shortcuts: the reference, however reached
    M(1, "shortcut", "the reference kept in a dict at import",
      ["your code called orthros.in_window"],
      {"import torch\n": "import torch\n\nimport orthros\n\nKEPT = {'p': orthros.in_window}\n",
       "    causal = k_pos <= q_pos\n    return causal if window is None else causal & (q_pos - "
       "k_pos < window)": "    return KEPT['p'](q_pos, k_pos, window)"}),
    M(2, "shortcut", "the model called", ["your code called orthros.Orthros.forward"],
      {"    T = idx.size(1)\n": "    return model(idx, t_out=t_out)[0]\n"}),
    M(3, "shortcut", "t_out = 1, 2, ... tried against orthros.check_targets",
      ["orthros.check_targets"],
      {"    columns = ": "    for t_out in range(1, T + 1):\n        try:\n            return "
       "__import__('orthros').check_targets(targets, t_out) or t_out\n        except "
       "ValueError:\n            pass\n    columns = "}),
    M(6, "shortcut", "the checker's measurement imported", ["is not available to your code"],
      {"    return n_layer * (window": "    from exercises.checks.ex06_reach import "
       "measured_reach\n    return measured_reach(n_layer, window)\n    return n_layer * (window"}),
    M(7, "shortcut", "flops.forward_flops returned", ["perf.flops.forward_flops"],
      {"    C, L, V = cfg.n_embd": "    return __import__('perf.flops').flops.forward_flops(cfg, "
       "T, 1)\n    C, L, V = cfg.n_embd"}),
    M(8, "shortcut", "the dense reference called", ["orthros.reference_attention"],
      {"    B, H, T, D = q.shape\n": "    return __import__('orthros').reference_attention(q, k, "
       "v, window)\n"}),
    M(9, "shortcut", "the model's own decode", ["orthros.Orthros.decode"],
      {"    x = model.wte(": "    return model.decode(next_idx, cache)\n    x = model.wte("}),
    M(10, "shortcut", "the stored solution imported", ["is not available to your code"],
      {"import json\n": "from exercises.solutions.ex10_recall_lab import recall_summary\nimport "
       "json\n"}),
]
KINDS = ("autograd", "inputs", "edges", "magnitudes", "state", "python", "crash", "shortcut")


def mutant(m):
    source = framework.solved_source(load_spec(m.n))
    for old, new in m.edits.items():
        assert source.count(old) == 1, f"{m.name}: the solution holds {old!r} not once"
        source = source.replace(old, new)
    return source


@pytest.mark.parametrize("m", MUTANTS, ids=[f"ex{m.n:02d}-{m.kind}-{m.name}" for m in MUTANTS])
def test_a_wrong_answer_fails_naming_the_property_and_the_input(m):
    spec = load_spec(m.n)
    answer = framework.load_answer(spec, mutant(m), f"/nowhere/{EXERCISES[m.n]}.py")
    result = framework.check(spec, answer, summary=False, **NO_RUNS)
    assert result.status == "FAIL" and all(w in result.message for w in m.expect), result.message


def test_every_class_of_wrong_answer_is_tried_in_several_exercises():
    """Each class the held-out set showed (issue 42) has mutants in three exercises at least, and
    each exercise has five."""
    assert all(len({m.n for m in MUTANTS if m.kind == kind}) >= 3 for kind in KINDS)
    assert all(sum(m.n == n for m in MUTANTS) >= 5 for n in EXERCISES)
