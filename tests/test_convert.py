"""
Converting Hugging Face checkpoints (convert/hf.py), held to transformers itself on CPU.

Tiny random models are built with transformers (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) and saved with save_pretrained, once per session, together with a tokenizer.json
built here. They cover grouped-query attention (4 query heads over 2 KV heads), SwiGLU, tied and
untied heads, rope_theta 500000 with Llama 3's RoPE scaling, RMSNorm eps 1e-5 (where it matters),
float32 and bfloat16, a sharded checkpoint, and Qwen3's per-head query and key norms with heads of
width 16 where hidden_size / num_attention_heads is 8. The tests prove:
  - with a window w >= T the converted model gives transformers' logits (paper section 3: with
    identity scale-offsets and a window that covers the sequence, Orthros is the Transformer);
  - with w < T the logits differ beyond the window, and training still equals prefill + decode;
  - the checkpoint's tokenizer encodes as transformers' does; bins hold ids beyond uint16;
  - what cannot be converted exactly is refused in one line that names the field;
  - sample.py and train.py take hf:DIR (greedy generation equals transformers' generate; 20
    steps of continued pre-training write a checkpoint that sample.py reads).
transformers is a test-only dependency; nothing here touches the network.
"""

import copy
import json
import os
import shutil
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import sample
import test_orthros
import train
from checkpoint import load_checkpoint, model_from_checkpoint
from convert.hf import convert_hf
from data.prepare_utils import PretrainBatches, load_meta, write_dataset
from data.shakespeare.prepare import prepare as prepare_text
from data.tokenizer import get_tokenizer
from orthros import llama3_inv_freq

VOCAB = 96                                   # ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3.. the words w3 ... w95
WORDS = [f"w{i}" for i in range(3, VOCAB)]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}  # wavelengths 6, 167, 4443, 118000: one per band
TOL = 1e-4                                   # max abs logit difference in float32


def tiny(config_class, **overrides):
    """A tiny config: width 32, 2 layers, 4 query heads over 2 KV heads, SwiGLU of width 48."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
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
    """A word-level tokenizer.json with BOS <s> prepended by its post-processor (as Llama's does) and
    EOS </s>, saved by transformers beside it. Words have no spaces, so a text decodes one way."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i for i, w in enumerate(WORDS, start=3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """{name: (folder, transformers model)}, each folder written by save_pretrained with the tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    llama3 = build(LlamaForCausalLM, tiny(LlamaConfig, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                          rope_theta=500000.0, rope_scaling=dict(LLAMA3)), seed=0, embedding_scale=0.01)
    made = {
        "llama3_gqa_untied": (llama3, {}),
        "tied_mha": (build(LlamaForCausalLM, tiny(LlamaConfig, num_key_value_heads=4, tie_word_embeddings=True), 1), {}),
        "sharded": (llama3, {"max_shard_size": "40KB"}),
        "bf16": (copy.deepcopy(llama3).to(torch.bfloat16), {}),
        "qwen2": (build(Qwen2ForCausalLM, tiny(Qwen2Config, tie_word_embeddings=True, rope_theta=1e6), 2), {}),
        "qwen3": (build(Qwen3ForCausalLM, tiny(Qwen3Config, head_dim=16, tie_word_embeddings=False,
                                               rope_theta=1e6), 3), {}),
    }
    out = {}
    for name, (model, save_args) in made.items():
        folder = root / name
        model.save_pretrained(folder, **save_args)
        save_tokenizer(folder)
        out[name] = (folder, model)
    return out


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def converted(folder, window, **overrides):
    return model_from_checkpoint(load_checkpoint(f"hf:{folder}"), window=window, **overrides).eval()


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
    """Converted with a window w = T, Orthros gives transformers' logits (max abs difference <= 1e-4, float32), at several T."""
    folder, model = hf[name]
    for T in (1, 9, 64, 200):
        idx = tokens(T)
        ours, _ = converted(folder, window=T)(idx)
        assert (ours - hf_logits(model, idx)).abs().max() <= TOL


def test_logits_differ_from_transformers_beyond_the_window(hf):
    """With w < T the logits equal transformers' at positions t < w and differ at every t >= w."""
    folder, model = hf["llama3_gqa_untied"]
    idx, w = tokens(40), 8
    diff = (converted(folder, window=w)(idx)[0] - hf_logits(model, idx)).abs().amax(dim=(0, 2))  # (T,)
    assert diff[:w].max() <= TOL
    assert diff[w:].min() > 100 * TOL


@pytest.mark.parametrize("name", ["llama3_gqa_untied", "qwen2", "qwen3"])
def test_converted_model_training_equals_prefill_plus_decode(hf, name):
    """The converted model (w < T) gives the same logits in one training forward as in prefill + decode steps."""
    model = converted(hf[name][0], window=8).double()
    idx = tokens(29)
    full, _ = model(idx)
    for p in (1, 8, 9, 20):
        torch.testing.assert_close(test_orthros.incremental_logits(model, idx, p), full[:, p - 1:], rtol=0, atol=1e-10)


def test_kv_cache_holds_the_kv_heads(hf):
    """Grouped-query attention: the KV cache holds num_key_value_heads = 2 heads, not the 4 query heads."""
    model = converted(hf["llama3_gqa_untied"][0], window=8)
    _, cache = model.prefill(tokens(11))
    assert model.blocks[0].attn.n_kv_head == 2
    assert all(layer.k.shape == layer.v.shape == (2, 2, 11, 8) for layer in cache.layers)


def test_rms_norm_eps_is_the_checkpoints(hf):
    """Where eps matters (tiny embeddings), the logits are transformers' with rms_norm_eps 1e-5 and not with torch's default."""
    folder, model = hf["llama3_gqa_untied"]
    idx = tokens(16)
    assert converted(folder, 16).ln_f.eps == 1e-5
    assert (converted(folder, 16)(idx)[0] - hf_logits(model, idx)).abs().max() <= TOL
    assert (converted(folder, 16, norm_eps=None)(idx)[0] - hf_logits(model, idx)).abs().max() > 100 * TOL


def test_llama3_rope_frequencies_equal_transformers():
    """Llama 3's RoPE scaling gives transformers' frequencies for Llama 3.1's settings, in all three bands."""
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    plain = 500000.0 ** -(torch.arange(0, 128, 2).float() / 128)
    ours = llama3_inv_freq(plain, config.rope_parameters)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert (ours == plain).any() and (ours == plain / 8).any() and ((ours != plain) & (ours != plain / 8)).any()


def test_tied_and_untied_heads(hf):
    """tie_word_embeddings decides whether the converted LM head is the embedding or a matrix of its own."""
    tied, untied = converted(hf["tied_mha"][0], 8), converted(hf["llama3_gqa_untied"][0], 8)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    torch.testing.assert_close(untied.lm_head.weight, hf["llama3_gqa_untied"][1].lm_head.weight, rtol=0, atol=0)


def test_sharded_checkpoint_gives_the_same_weights(hf):
    """A checkpoint saved in shards (with model.safetensors.index.json) converts to the same state dict as one file."""
    assert len(list(hf["sharded"][0].glob("model-*.safetensors"))) > 1
    one, shards = load_checkpoint(f"hf:{hf['llama3_gqa_untied'][0]}"), load_checkpoint(f"hf:{hf['sharded'][0]}")
    assert one["model"].keys() == shards["model"].keys()
    assert all(torch.equal(one["model"][k], shards["model"][k]) for k in one["model"])


def test_bf16_checkpoint_keeps_its_dtype_and_weights(hf):
    """A bfloat16 checkpoint converts to bfloat16 weights equal to the file's, and a bfloat16 model."""
    folder, model = hf["bf16"]
    ckpt = load_checkpoint(f"hf:{folder}")
    assert all(t.dtype == torch.bfloat16 for t in ckpt["model"].values())
    assert torch.equal(ckpt["model"]["blocks.1.mlp.c_gate.weight"], model.model.layers[1].mlp.gate_proj.weight)
    assert model_from_checkpoint(ckpt).wte.weight.dtype == torch.bfloat16


def test_bf16_logits_match_transformers(hf):
    """A bfloat16 checkpoint gives transformers' logits: to bfloat16 precision in bfloat16, and to 1e-4 both cast to float32."""
    folder = hf["bf16"][0]
    idx = tokens(32)
    theirs = hf_logits(LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval(), idx).float()
    assert (converted(folder, 32)(idx)[0].float() - theirs).abs().max() <= 0.05 * theirs.abs().max()
    theirs = hf_logits(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), idx)
    assert (converted(folder, 32).float()(idx)[0] - theirs).abs().max() <= TOL


def test_identity_scale_offsets_and_the_window(hf):
    """The conversion is Orthros with alpha = 1, beta = 0 in every layer, window 128 unless asked, at step 0."""
    ckpt = load_checkpoint(f"hf:{hf['tied_mha'][0]}")
    assert ckpt["model_config"]["attn"] == "orthros" and ckpt["model_config"]["window"] == 128 and ckpt["step"] == 0
    for i in range(2):
        for name, value in (("alpha", 1.0), ("beta", 0.0), ("alpha_out", 1.0), ("beta_out", 0.0)):
            assert torch.equal(ckpt["model"][f"blocks.{i}.attn.{name}"], torch.full((32,), value))
    assert convert_hf(hf["tied_mha"][0], window=5)[0]["window"] == 5


def test_checkpoint_written_before_the_options_loads():
    """A checkpoint whose model_config has none of the conversion options loads into today's model (tied, GELU, MHA)."""
    old = dict(vocab_size=37, n_layer=1, n_head=2, n_embd=16, window=4, attn="orthros", scale_offset=True, max_seq_len=64,
               rope_base=10000.0, dropout=0.0, conv_kernel=0, swa_impl="auto")
    state = test_orthros.make_model(**{k: old[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd", "window")},
                                    dtype=torch.float32).state_dict()
    model = model_from_checkpoint({"model_config": old, "model": state})
    assert model.lm_head.weight is model.wte.weight and model.blocks[0].mlp.c_gate is None
    assert model.blocks[0].attn.c_k.weight.shape == (16, 16)


# -----------------------------------------------------------------------------
# The checkpoint's tokenizer, and data prepared with it

def test_tokenizer_encodes_as_transformers(hf):
    """hf:DIR's tokenizer gives transformers' ids for a prompt (BOS first), its EOS as eot, and decodes back."""
    folder = hf["tied_mha"][0]
    ours, theirs = get_tokenizer(f"hf:{folder}"), AutoTokenizer.from_pretrained(folder)
    for text in ("w3 w4 w95", "w17", "w5 unknown w6"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode("w7 w8")[0] == ours.bos == 1
    assert (ours.eot, ours.vocab_size, ours.name) == (theirs.eos_token_id, VOCAB, f"hf:{folder.resolve()}")
    assert ours.decode(ours.encode("w9 w10")) == "<s> w9 w10"


def test_checkpoint_records_its_tokenizer(hf):
    """The converted checkpoint names its folder's tokenizer, as a dataset prepared with that tokenizer does."""
    ckpt = load_checkpoint(f"hf:{hf['tied_mha'][0]}")
    assert ckpt["tokenizer"] == get_tokenizer(ckpt["tokenizer"]).name == ckpt["source"]


def test_prepared_text_is_bos_text_eos_in_the_checkpoints_tokenizer(hf, tmp_path):
    """prepare --tokenizer hf:DIR writes each document as [BOS] ids EOS and records the tokenizer in meta.json."""
    tok = get_tokenizer(f"hf:{hf['tied_mha'][0]}")
    write_dataset(tmp_path, tok, ["w3 w4", "w5"], ["w6"], source="test")
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [1, 3, 4, 2, 1, 5, 2]
    assert load_meta(tmp_path)["tokenizer"] == tok.name and load_meta(tmp_path)["dtype"] == "uint16"


class Llama3SizedTokenizer:
    """A stand-in with Llama 3's 128,256 ids: each character c becomes the id 128000 + ord(c) % 256."""
    name, vocab_size, eot = "llama3-sized", 128256, 128255

    def encode(self, text):
        return [128000 + ord(c) % 256 for c in text]


def test_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    """A vocabulary of more than 65,536 ids is written as uint32 (so recorded in meta.json) and read back whole."""
    tok = Llama3SizedTokenizer()
    write_dataset(tmp_path, tok, ["abcdefgh" * 4], ["hgfedcba" * 4], source="test")
    assert load_meta(tmp_path)["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint32).tolist() == tok.encode("abcdefgh" * 4) + [tok.eot]
    x, y, _ = PretrainBatches(tmp_path, seq_len=8).get("val", 2, torch.Generator().manual_seed(0))
    assert x.min() >= 128000 and set(y.flatten().tolist()) <= set(tok.encode("hgfedcba") + [tok.eot])


# -----------------------------------------------------------------------------
# What cannot be converted exactly: one line each, naming the field

def edited_copy(folder, tmp_path, config=None, weights=None, drop=()):
    """A copy of a checkpoint folder with config.json's fields updated, tensors added or replaced, files removed."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    if config:
        hf_config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**hf_config, **config}))
    if weights:
        save_file({**load_file(out / "model.safetensors"), **weights}, out / "model.safetensors")
    for name in drop:
        (out / name).unlink()
    return out


@pytest.mark.parametrize("config,words", [
    ({"architectures": ["GPT2LMHeadModel"]}, ["architectures", "LlamaForCausalLM"]),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, ["architectures"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"hidden_act": "gelu"}, ["hidden_act"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ["rope_parameters", "yarn"]),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling", "linear"]),
    ({"head_dim": 15}, ["head_dim"]),   # RoPE turns pairs of channels
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, ["sliding_window"]),
    ({"architectures": ["MistralForCausalLM"]}, ["sliding_window"]),   # absent: Mistral's default, 4096
    ({"tie_word_embeddings": False}, ["tie_word_embeddings", "lm_head.weight"]),
])
def test_config_that_does_not_convert_exactly_is_refused(hf, tmp_path, config, words):
    """Each config Orthros cannot compute exactly is refused in one line naming the field."""
    with pytest.raises(ValueError) as e:
        load_checkpoint(f"hf:{edited_copy(hf['tied_mha'][0], tmp_path, config)}")
    one_line_error(e, *words)


@pytest.mark.parametrize("weights,words", [
    ({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, ["QK-norm", "q_norm"]),
    ({"model.layers.1.self_attn.o_proj.bias": torch.zeros(32)}, ["bias", "o_proj"]),
    ({"lm_head.weight": torch.zeros(VOCAB, 32)}, ["tie_word_embeddings", "lm_head.weight"]),
    ({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)}, ["k_proj", "shape"]),
])
def test_weights_that_do_not_convert_exactly_are_refused(hf, tmp_path, weights, words):
    """A weight Orthros has no place for (QK-norm, a bias), an untied head said to be tied, or a wrong shape: one line."""
    with pytest.raises(ValueError) as e:
        load_checkpoint(f"hf:{edited_copy(hf['tied_mha'][0], tmp_path, weights=weights)}")
    one_line_error(e, *words)


@pytest.mark.parametrize("config,words", [({"use_sliding_window": True}, ["use_sliding_window"]),
                                          ({"attention_bias": True}, ["attention_bias"])])
def test_qwen3_fields_that_do_not_convert_exactly_are_refused(hf, tmp_path, config, words):
    """Qwen3's own sliding window, and its biases (on W_O too), are refused in one line naming the
    field."""
    with pytest.raises(ValueError) as e:
        load_checkpoint(f"hf:{edited_copy(hf['qwen3'][0], tmp_path, config)}")
    one_line_error(e, *words)


def test_missing_shard_is_refused(hf, tmp_path):
    """A shard that the index lists but the folder lacks is named in one line."""
    shard = sorted(p.name for p in hf["sharded"][0].glob("model-*.safetensors"))[1]
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(f"hf:{edited_copy(hf['sharded'][0], tmp_path, drop=[shard])}")
    one_line_error(e, shard)


def test_missing_tokenizer_is_refused(hf, tmp_path):
    """A folder without tokenizer.json is refused in one line naming the path, by the loader and by
    the tokenizer."""
    folder = edited_copy(hf["tied_mha"][0], tmp_path, drop=["tokenizer.json"])
    for load in (lambda: load_checkpoint(f"hf:{folder}"), lambda: get_tokenizer(f"hf:{folder}")):
        with pytest.raises(FileNotFoundError) as e:
            load()
        one_line_error(e, str(folder.resolve() / "tokenizer.json"))


def test_missing_folder_or_weights_are_refused(hf, tmp_path):
    """No such folder, or no safetensors weights in it: one line each."""
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(f"hf:{tmp_path / 'nowhere'}")
    one_line_error(e, "config.json")
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(f"hf:{edited_copy(hf['tied_mha'][0], tmp_path, drop=['model.safetensors'])}")
    one_line_error(e, "model.safetensors")


def test_window_below_one_is_refused(hf):
    """A window <= 0 is refused in one line naming the window, at conversion and when the model is built."""
    for window in (0, -3):
        with pytest.raises(ValueError) as e:
            convert_hf(hf["tied_mha"][0], window=window)
        one_line_error(e, "window")
        with pytest.raises(ValueError) as e:
            model_from_checkpoint(load_checkpoint(f"hf:{hf['tied_mha'][0]}"), window=window)
        one_line_error(e, "window")


@pytest.mark.parametrize("module", ["safetensors.torch", "tokenizers"])
def test_missing_package_names_the_pip_command(hf, monkeypatch, module):
    """Without safetensors or tokenizers, an hf: checkpoint is refused in one line naming the pip command."""
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ImportError) as e:
        load_checkpoint(f"hf:{hf['tied_mha'][0]}") if module != "tokenizers" else get_tokenizer(f"hf:{hf['tied_mha'][0]}")
    one_line_error(e, f"pip install {module.split('.')[0]}")


# -----------------------------------------------------------------------------
# The commands: sample.py --ckpt hf:DIR, train.py --init_from hf:DIR

def sample_json(capsys, *args):
    """Run sample.py's main on CPU and return its --json record."""
    capsys.readouterr()
    sample.main(["--device", "cpu", "--json", *args])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["llama3_gqa_untied", "qwen3"])
def test_sample_greedy_equals_transformers_generate(hf, capsys, name):
    """sample.py --ckpt hf:DIR --temperature 0 (w >= T) generates transformers' generate(do_sample=False), token for token."""
    folder, model = hf[name]
    prompt, n = "w5 w9 w17 w3 w40", 20
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt")["input_ids"]
    model.generation_config.eos_token_id = None  # all n tokens, as --no_stop
    theirs = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)[0, ids.size(1):].tolist()
    record = sample_json(capsys, "--ckpt", f"hf:{folder}", "--temperature", "0", "--prompt", prompt,
                         "--max_new_tokens", str(n), "--no_stop")
    assert record["samples"] == [prompt + get_tokenizer(f"hf:{folder}").decode(theirs)]


@pytest.mark.parametrize("attn", ["orthros", "swa"])
def test_sample_window_option_converts_with_that_window(hf, capsys, attn):
    """sample.py --ckpt hf:DIR --window 4 (--attn swa: as its SWA baseline) generates what the model
    converted with window 4 generates."""
    folder = hf["llama3_gqa_untied"][0]
    prompt, tok = "w5 w9 w17 w3 w40 w41 w42", get_tokenizer(f"hf:{folder}")
    idx = torch.tensor([tok.encode(prompt)])
    ours = converted(folder, 4, attn=attn).generate(idx, 16, temperature=0)[0, idx.size(1):]
    wide = converted(folder, 128).generate(idx, 16, temperature=0)[0, idx.size(1):]
    assert not torch.equal(ours, wide)
    record = sample_json(capsys, "--ckpt", f"hf:{folder}", "--window", "4", "--attn", attn,
                         "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "16",
                         "--no_stop")
    assert record["samples"] == [prompt + tok.decode(ours.tolist())]


def test_sample_refuses_a_window_below_one(hf):
    """sample.py --ckpt hf:DIR --window 0 stops with one line naming the window."""
    with pytest.raises(SystemExit) as e:
        sample.main(["--ckpt", f"hf:{hf['tied_mha'][0]}", "--window", "0", "--prompt", "w3", "--device", "cpu"])
    one_line_error(e, "window", ">= 1")


@pytest.mark.parametrize("attn", ["orthros", "transformer"])
def test_cpt_from_hf_writes_a_checkpoint_that_sample_reads(hf, tmp_path, capsys, attn):
    """train.py --init_from hf:DIR: 20 steps of CPT (Orthros, or the Transformer as Base CPT) on
    data prepared with the checkpoint's tokenizer write a checkpoint of the converted shape that
    records its source, and sample.py reads it after DIR is gone (it keeps its tokenizer)."""
    folder = tmp_path / "hf"
    shutil.copytree(hf["llama3_gqa_untied"][0], folder)
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(WORDS[:20], 3000)))
    prepare_text(tmp_path / "corpus.txt", tmp_path / "data", tokenizer=f"hf:{folder}")
    out = tmp_path / "run"
    train.main(["--config", "tiny", "--init_from", f"hf:{folder}", "--dataset", str(tmp_path / "data"), "--attn", attn,
                "--window", "16", "--seq_len", "32", "--batch_size", "4", "--max_iters", "20", "--warmup_iters", "2",
                "--eval_interval", "20", "--eval_iters", "1", "--device", "cpu", "--dtype", "float32", "--out_dir", str(out)])
    ckpt = load_checkpoint(out / "ckpt_last.pt")
    assert ckpt["step"] == 20 and ckpt["train_config"]["init_from"] == f"hf:{folder}"
    assert ckpt["tokenizer"] == f"hf:{folder.resolve()}"
    config = ckpt["model_config"]
    assert (config["attn"], config["n_kv_head"], config["mlp"], config["tie_embeddings"]) == (attn, 2, "swiglu", False)
    assert config["rope_scaling"] == LLAMA3 and config["norm_eps"] == 1e-5
    shutil.rmtree(folder)
    record = sample_json(capsys, "--ckpt", str(out / "ckpt_last.pt"), "--prompt", "w3 w4", "--max_new_tokens", "5")
    assert record["samples"][0].startswith("w3 w4")


def test_an_hf_start_without_a_config_says_what_runs(hf, tmp_path, monkeypatch, capsys):
    """train.py --init_from hf:DIR without --config, on a CPU: no note about the small preset (a GPU
    config), and the config line says it runs the defaults with the model of hf:DIR, its shape."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = hf["llama3_gqa_untied"][0]
    (tmp_path / "corpus.txt").write_text(" ".join(WORDS * 20))
    prepare_text(tmp_path / "corpus.txt", tmp_path / "data", tokenizer=f"hf:{folder}")
    train.main(["--init_from", f"hf:{folder}", "--dataset", str(tmp_path / "data"), "--seq_len",
                "16", "--batch_size", "1", "--max_iters", "0", "--eval_iters", "1",
                "--device", "cpu", "--out_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "small" not in out
    assert f"no --config: the defaults, the model of hf:{folder}: " in out
    assert "n_layer=2, n_head=4, n_embd=32" in out


def test_a_converted_model_runs_as_its_baselines_and_a_trained_one_does_not(hf):
    """model_from_checkpoint(ckpt, attn=...) drops identity scale-offsets: a converted model runs as its Transformer
    (transformers' logits at any window) and its SWA baseline (transformers' logits within the window only); trained
    scale-offsets are refused in one line."""
    folder, model = hf["llama3_gqa_untied"]
    ckpt, idx = load_checkpoint(f"hf:{folder}"), tokens(24)
    transformer = model_from_checkpoint(ckpt, attn="transformer", window=4).eval()
    assert not any(name.endswith("alpha") for name, _ in transformer.named_parameters())
    assert (transformer(idx)[0] - hf_logits(model, idx)).abs().max() < TOL
    theirs = hf_logits(model, idx)
    assert (model_from_checkpoint(ckpt, attn="swa", window=24).eval()(idx)[0] - theirs).abs().max() < TOL  # w >= T
    swa = model_from_checkpoint(ckpt, attn="swa", window=4).eval()(idx)[0]
    assert (swa[:, :4] - theirs[:, :4]).abs().max() < TOL < (swa[:, 4:] - theirs[:, 4:]).abs().max()
    trained = {**ckpt, "model": {**ckpt["model"], "blocks.0.attn.beta": torch.full_like(ckpt["model"]["blocks.0.attn.beta"], 0.5)}}
    with pytest.raises(ValueError) as e:
        model_from_checkpoint(trained, attn="swa")
    one_line_error(e, "blocks.0.attn.beta", "trained")
