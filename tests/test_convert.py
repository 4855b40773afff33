"""
convert/hf.py, held to transformers on tiny random Llama, Qwen2 and Qwen3 models saved here: with
w >= T the converted model is the Transformer (paper section 3), what cannot be converted exactly
is refused in one line, and the tokenizer, sample.py and train.py take hf:DIR. Offline.
"""

import copy
import json
import os
import shutil
import sys
import types

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import sample
import test_orthros
import train
from checkpoint import load_checkpoint, model_from_checkpoint
from convert.hf import convert_hf
from data.prepare_utils import PretrainBatches, load_meta, write_dataset
from data.shakespeare.prepare import prepare as prepare_text
from data.tokenizer import get_tokenizer

VOCAB = 96                   # ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3.. the words w3 ... w95
WORDS = [f"w{i}" for i in range(3, VOCAB)]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}  # wavelengths 6, 167, 4443, 118000: one per band
TOL = 1e-4                   # max abs logit difference in float32


def tiny(config_class, **overrides):
    """A tiny config: width 32, 2 layers, 4 query heads over 2 KV heads, SwiGLU of width 48."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    return config_class(**{**kw, **overrides})


def build(model_class, config, seed, embedding_scale=1.0):
    """A random model in eval mode, its norms and biases moved off their init (ones, zeros) so that
    a wrong mapping shows. embedding_scale < 1 makes the first norm's eps matter."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
        model.model.embed_tokens.weight.mul_(embedding_scale)
    return model


def save_tokenizer(folder):
    """A word-level tokenizer.json with BOS <s> prepended by its post-processor (as Llama's does)
    and EOS </s>, saved by transformers beside it. Words have no spaces: a text decodes one way."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i for i, w in enumerate(WORDS, start=3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """{name: (folder, transformers model)}, each saved by save_pretrained, with the tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    llama3 = build(LlamaForCausalLM, tiny(LlamaConfig, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                          rope_theta=500000.0, rope_scaling=dict(LLAMA3)),
                   seed=0, embedding_scale=0.01)
    tied = tiny(LlamaConfig, num_key_value_heads=4, tie_word_embeddings=True)
    qwen2 = tiny(Qwen2Config, tie_word_embeddings=True, rope_theta=1e6)
    qwen3 = tiny(Qwen3Config, head_dim=16, tie_word_embeddings=False, rope_theta=1e6)
    models = {"llama3_gqa_untied": llama3, "tied_mha": build(LlamaForCausalLM, tied, 1),
              "sharded": llama3, "bf16": copy.deepcopy(llama3).to(torch.bfloat16),
              "qwen2": build(Qwen2ForCausalLM, qwen2, 2),
              "qwen3": build(Qwen3ForCausalLM, qwen3, 3)}
    for name, model in models.items():
        shards = {"max_shard_size": "40KB"} if name == "sharded" else {}
        model.save_pretrained(root / name, **shards)
        save_tokenizer(root / name)
    return {name: (root / name, model) for name, model in models.items()}


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def tokens(T, B=2, seed=0):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def one_line_error(excinfo, *words):
    """The error is one line and names each of words."""
    message = str(excinfo.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# -----------------------------------------------------------------------------
# With w >= T the converted model is the Transformer; with w < T it is Orthros

@pytest.mark.parametrize("name", ["llama3_gqa_untied", "tied_mha", "sharded", "qwen2", "qwen3"])
def test_logits_equal_transformers_when_the_window_covers_the_sequence(hf, name):
    """Converted with a window w = T, Orthros gives transformers' logits (to 1e-4 in float32)."""
    folder, model = hf[name]
    ckpt = load_checkpoint(f"hf:{folder}")
    for T in (1, 9, 64, 200):
        idx = tokens(T)
        ours = model_from_checkpoint(ckpt, window=T).eval()(idx)[0]
        assert (ours - hf_logits(model, idx)).abs().max() <= TOL


def test_bf16_checkpoint_converts_in_bf16_with_transformers_logits(hf):
    """A bfloat16 checkpoint converts as the file's bfloat16 weights, with transformers' logits."""
    folder, model = hf["bf16"]
    ckpt = load_checkpoint(f"hf:{folder}")
    gate = model.model.layers[1].mlp.gate_proj.weight
    assert torch.equal(ckpt["model"]["blocks.1.mlp.c_gate.weight"], gate)
    ours, idx = model_from_checkpoint(ckpt).eval(), tokens(32)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    theirs = lambda dtype: hf_logits(LlamaForCausalLM.from_pretrained(folder, dtype=dtype), idx)
    bf16 = theirs(torch.bfloat16).float()
    assert (ours(idx)[0].float() - bf16).abs().max() <= 0.05 * bf16.abs().max()
    theirs = theirs(torch.float32)
    assert (ours.float()(idx)[0] - theirs).abs().max() <= TOL


def test_beyond_the_window_orthros_and_swa_differ_and_a_trained_model_is_no_baseline(hf):
    """Converted with w < T, Orthros and SWA give transformers' logits at t < w and differ at every
    t >= w; the Transformer baseline is transformers'; a trained model is refused as SWA."""
    folder, model = hf["llama3_gqa_untied"]
    ckpt, T = load_checkpoint(f"hf:{folder}"), 40
    idx = tokens(T)
    theirs = hf_logits(model, idx)
    for attn, w, same in [("orthros", 8, 8), ("swa", 4, 4), ("swa", T, T), ("transformer", 4, T)]:
        ours = model_from_checkpoint(ckpt, attn=attn, window=w).eval()(idx)[0]
        diff = (ours - theirs).abs().amax(dim=(0, 2))   # (T,)
        assert diff[:same].max() <= TOL and (same == T or diff[same:].min() > 100 * TOL), attn
    beta = ckpt["model"]["blocks.0.attn.beta"]
    trained = {**ckpt, "model": {**ckpt["model"], "blocks.0.attn.beta": torch.full_like(beta, 0.5)}}
    with pytest.raises(ValueError) as e:
        model_from_checkpoint(trained, attn="swa")
    one_line_error(e, "blocks.0.attn.beta", "trained")


def test_checkpoint_written_before_the_options_loads():
    """A checkpoint made before the conversion options loads as the model it was saved from."""
    old = dict(vocab_size=37, n_layer=1, n_head=2, n_embd=16, window=4, attn="orthros",
               scale_offset=True, max_seq_len=64, rope_base=10000.0, dropout=0.0, conv_kernel=0,
               swa_impl="auto")
    saved = test_orthros.make_model(n_layer=1, window=4, max_seq_len=64, dtype=torch.float32)
    model = model_from_checkpoint({"model_config": old, "model": saved.state_dict()})
    idx = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(model(idx)[0], saved(idx)[0], rtol=0, atol=0)


# -----------------------------------------------------------------------------
# The checkpoint's tokenizer, and data prepared with it

def test_tokenizer_encodes_as_transformers(hf):
    """hf:DIR's tokenizer gives transformers' ids (BOS first), its EOS as eot, and decodes back."""
    folder = hf["tied_mha"][0]
    ours, theirs = get_tokenizer(f"hf:{folder}"), AutoTokenizer.from_pretrained(folder)
    for text in ("w3 w4 w95", "w17", "w5 unknown w6"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode("w7 w8")[0] == ours.bos == 1
    assert (ours.eot, ours.vocab_size) == (theirs.eos_token_id, VOCAB)
    assert ours.decode(ours.encode("w9 w10")) == "<s> w9 w10"


def test_prepared_data_holds_each_document_and_every_id(hf, tmp_path):
    """Prepared data holds each document as [BOS] ids EOS, in uint32 past 65,536 ids."""
    tok = get_tokenizer(f"hf:{hf['tied_mha'][0]}")
    ids = lambda folder, dtype: np.fromfile(folder / "train.bin", dtype=dtype).tolist()
    write_dataset(tmp_path / "small", tok, ["w3 w4", "w5"], ["w6"], source="test")
    assert ids(tmp_path / "small", np.uint16) == [1, 3, 4, 2, 1, 5, 2]
    assert load_meta(tmp_path / "small")["tokenizer"] == tok.name
    tok = types.SimpleNamespace(name="llama3-sized", vocab_size=128256, eot=128255,  # Llama 3
                                encode=lambda text: [128000 + ord(c) % 256 for c in text])
    write_dataset(tmp_path, tok, ["abcdefgh" * 4], ["hgfedcba" * 4], source="test")
    assert load_meta(tmp_path)["dtype"] == "uint32"
    assert ids(tmp_path, np.uint32) == tok.encode("abcdefgh" * 4) + [tok.eot]
    x, y, _ = PretrainBatches(tmp_path, seq_len=8).get("val", 2, torch.Generator().manual_seed(0))
    assert x.min() >= 128000 and set(y.flatten().tolist()) <= {*tok.encode("hgfedcba"), tok.eot}


# -----------------------------------------------------------------------------
# What cannot be converted exactly: one line each, naming the field

def config(fields, *words, name="tied_mha"):   # a checkpoint whose config.json has these fields
    return name, fields, {}, [], words


def weights(tensors, *words):                     # ... that has these tensors added or replaced
    return "tied_mha", {}, tensors, [], words


def dropped(pattern, *words, name="tied_mha"):    # ... whose files matching pattern are removed
    return name, {}, {}, [pattern], words


REFUSED = {  # each edited copy of a checkpoint, and the words its error names ({folder}: its path)
    "GPT-2": config({"architectures": ["GPT2LMHeadModel"]}, "architectures", "LlamaForCausalLM"),
    "MoE": config({"architectures": ["Qwen3MoeForCausalLM"]}, "architectures"),
    "attention_bias": config({"attention_bias": True}, "attention_bias"),
    "mlp_bias": config({"mlp_bias": True}, "mlp_bias"),
    "hidden_act": config({"hidden_act": "gelu"}, "hidden_act"),
    "yarn": config({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
                   "rope_parameters", "yarn"),
    "linear": config({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2}},
                     "rope_scaling", "linear"),
    "odd head_dim": config({"head_dim": 15}, "head_dim"),   # RoPE turns pairs of channels
    "Mistral's window": config({"architectures": ["MistralForCausalLM"], "sliding_window": 4096},
                               "sliding_window"),
    "Mistral's default": config({"architectures": ["MistralForCausalLM"]}, "sliding_window"),
    "untied, no head": config({"tie_word_embeddings": False}, "tie_word_embeddings",
                              "lm_head.weight"),
    "Qwen3's window": config({"use_sliding_window": True}, "use_sliding_window", name="qwen3"),
    "Qwen3's biases": config({"attention_bias": True}, "attention_bias", name="qwen3"),
    "QK-norm": weights({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, "q_norm"),
    "o_proj bias": weights({"model.layers.1.self_attn.o_proj.bias": torch.zeros(32)}, "o_proj"),
    "tied, a head": weights({"lm_head.weight": torch.zeros(VOCAB, 32)}, "tie_word_embeddings",
                            "lm_head.weight"),
    "a wrong shape": weights({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)},
                             "k_proj", "shape"),
    "no shard 2": dropped("model-00002-*", "model-00002-of-", name="sharded"),
    "no weights": dropped("model.safetensors", "model.safetensors"),
    "no config": dropped("config.json", "config.json"),
    "no tokenizer": dropped("tokenizer.json", "{folder}/tokenizer.json"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_does_not_convert_exactly_is_refused(hf, tmp_path, case):
    """What Orthros cannot compute exactly, or a missing file, is refused in one line."""
    from safetensors.torch import load_file, save_file
    name, config, weights, drop, words = REFUSED[case]
    folder = tmp_path / "edited"
    shutil.copytree(hf[name][0], folder)
    if config:
        hf_config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**hf_config, **config}))
    if weights:
        file = folder / "model.safetensors"
        save_file({**load_file(file), **weights}, file)
    for pattern in drop:
        for file in folder.glob(pattern):
            file.unlink()
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_checkpoint(f"hf:{folder}")
    one_line_error(e, *(word.format(folder=folder.resolve()) for word in words))


def test_window_below_one_is_refused(hf):
    """A window below 1 is refused in one line, by the conversion and by sample.py."""
    folder = hf["tied_mha"][0]
    with pytest.raises(ValueError) as e:
        convert_hf(folder, window=0)
    one_line_error(e, "window")
    with pytest.raises(SystemExit) as e:
        sample.main(f"--ckpt hf:{folder} --window 0 --prompt w3 --device cpu".split())
    one_line_error(e, "window")


@pytest.mark.parametrize("module", ["safetensors.torch", "tokenizers"])
def test_missing_package_names_the_pip_command(hf, monkeypatch, module):
    """Without safetensors or tokenizers, hf: is refused in one line naming the pip command."""
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    load = get_tokenizer if module == "tokenizers" else load_checkpoint
    with pytest.raises(ImportError) as e:
        load(f"hf:{hf['tied_mha'][0]}")
    one_line_error(e, f"pip install {module.split('.')[0]}")


# -----------------------------------------------------------------------------
# train.py --init_from hf:DIR, and sample.py on its checkpoint

@pytest.mark.parametrize("attn", ["orthros", "transformer"])
def test_cpt_from_hf_writes_a_checkpoint_that_sample_reads(hf, tmp_path, capsys, attn):
    """CPT from hf:DIR writes the converted model's checkpoint, which sample.py reads."""
    folder = tmp_path / "hf"
    shutil.copytree(hf["llama3_gqa_untied"][0], folder)
    words = np.random.default_rng(0).choice(WORDS[:20], 3000)
    (tmp_path / "corpus.txt").write_text(" ".join(words))
    prepare_text(tmp_path / "corpus.txt", tmp_path / "data", tokenizer=f"hf:{folder}")
    out = tmp_path / "run"
    train.main(f"--config tiny --init_from hf:{folder} --dataset {tmp_path / 'data'} --attn {attn} "
               "--window 16 --seq_len 32 --batch_size 4 --max_iters 4 --warmup_iters 2 "
               f"--eval_interval 4 --eval_iters 1 --device cpu --dtype float32 --out_dir {out}"
               .split())
    ckpt = load_checkpoint(out / "ckpt_last.pt")
    assert ckpt["step"] == 4 and ckpt["train_config"]["init_from"] == f"hf:{folder}"
    assert ckpt["tokenizer"] == f"hf:{folder.resolve()}"
    config = ckpt["model_config"]
    shape = dict(attn=attn, n_kv_head=2, mlp="swiglu", tie_embeddings=False, rope_scaling=LLAMA3,
                 norm_eps=1e-5)
    assert {k: config[k] for k in shape} == shape
    shutil.rmtree(folder)   # the checkpoint holds the tokenizer's files
    capsys.readouterr()
    sample.main(f"--ckpt {out}/ckpt_last.pt --prompt w3 --max_new_tokens 5 --json --device cpu"
                .split())
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["samples"][0].startswith("w3")
