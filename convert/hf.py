"""
A Hugging Face folder of a Llama, Mistral (without its window), Qwen2 or Qwen3 model as an Orthros
checkpoint (config.json, *.safetensors, tokenizer.json): the paper's conversion (section 4.3), a
weight copy with identity scale-offsets, in the weights' dtype; with a window w >= T, Orthros is
the Transformer it came from (section 3). What it cannot compute exactly is refused in one line.
load_checkpoint("hf:DIR") calls convert_hf.
"""

import dataclasses
import json
from pathlib import Path

import torch

from data.tokenizer import hf_tokenizer_file, require
from orthros import LLAMA3_ROPE_KEYS, Orthros, OrthrosConfig, identity_scale_offset

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# One layer's weights: Hugging Face's name (after model.layers.i.) -> Orthros's (after blocks.i.)
LAYER = {"input_layernorm.weight": "ln_1.weight", "self_attn.o_proj.weight": "attn.c_proj.weight",
         **{f"self_attn.{p}_proj.weight": f"attn.c_{p}.weight" for p in "qkv"},
         "post_attention_layernorm.weight": "ln_2.weight", "mlp.up_proj.weight": "mlp.c_fc.weight",
         "mlp.gate_proj.weight": "mlp.c_gate.weight", "mlp.down_proj.weight": "mlp.c_proj.weight"}
QKV_BIASES = {f"self_attn.{p}_proj.bias": f"attn.c_{p}.bias" for p in "qkv"}  # Qwen2's
QK_NORMS = {f"self_attn.{p}_norm.weight": f"attn.{p}_norm.weight" for p in "qk"}  # Qwen3's


def convert_hf(folder, window=128, device="cpu"):
    """(OrthrosConfig's fields, state dict) of the model in folder at window w."""
    folder = Path(folder).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"hf:{folder}: no config.json there; give the folder of a Hugging "
                                "Face checkpoint (config.json, *.safetensors, tokenizer.json)")
    hf_tokenizer_file(folder)  # without it a checkpoint can be neither sampled nor trained on
    config = orthros_config(json.loads((folder / "config.json").read_text()), window, folder)
    return config, orthros_state_dict(read_safetensors(folder, device), config, folder)


def orthros_config(hf, window, folder):
    """OrthrosConfig's fields for config.json's model; a ValueError naming a field that differs."""
    def refuse(field, why):
        raise ValueError(f"{folder}/config.json: {field} = {hf.get(field)!r}: {why}")

    def need(field):
        if field not in hf:
            raise ValueError(f"{folder}/config.json has no {field}; is it a model's config?")
        return hf[field]

    architectures = hf.get("architectures") or []
    architecture = architectures[0] if len(architectures) == 1 else None
    if architecture not in ARCHITECTURES:
        refuse("architectures", f"only {', '.join(ARCHITECTURES)} convert exactly into Orthros")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "Orthros's SwiGLU MLP uses silu")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            refuse(field, "Orthros has no bias on W_O or in the MLP")
    # Qwen2 and Qwen3 switch their window on; Mistral's is on (4096) unless config.json says null.
    own_window = "use_sliding_window" if architecture.startswith("Qwen") else "sliding_window"
    if hf.get(own_window, 4096 if architecture == "MistralForCausalLM" else None):
        refuse(own_window, "the model's own sliding window is not a Transformer's full "
               "attention, which the conversion starts from")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        refuse("layer_types", "every layer must be full attention")
    C, H = need("hidden_size"), need("num_attention_heads")
    if hf.get("head_dim") is None and C % H:
        refuse("num_attention_heads", f"does not divide hidden_size={C}, and there is no head_dim")
    # transformers >= 5 writes rope_parameters, older ones rope_scaling
    rope_field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_field) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        refuse(rope_field, f"RoPE type {rope_type!r}: only the default and Llama 3's (llama3)")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(rope_field, "partial_rotary_factor: Orthros rotates every channel of a head")
    scaling = None
    if rope_type == "llama3":  # transformers' default original_max_position_embeddings
        rope = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **rope}
        if any(rope.get(key) is None for key in LLAMA3_ROPE_KEYS):
            refuse(rope_field, f"llama3 RoPE scaling needs {', '.join(LLAMA3_ROPE_KEYS)}")
        scaling = {"rope_type": "llama3", **{key: rope[key] for key in LLAMA3_ROPE_KEYS}}
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (the sliding window w), got {window!r}")
    try:
        config = OrthrosConfig(
            vocab_size=need("vocab_size"), n_layer=need("num_hidden_layers"), n_head=H, n_embd=C,
            n_kv_head=hf.get("num_key_value_heads") or H, window=window, attn="orthros",
            max_seq_len=hf.get("max_position_embeddings", 2048), rope_scaling=scaling,
            rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), mlp="swiglu",
            mlp_hidden=need("intermediate_size"), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            head_dim=hf.get("head_dim"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM", qk_norm=architecture == "Qwen3ForCausalLM")
    except ValueError as e:  # e.g. an odd head size, which RoPE cannot rotate in pairs
        raise ValueError(f"{folder}/config.json does not fit Orthros: {e}") from None
    return dataclasses.asdict(config)


def read_safetensors(folder, device="cpu"):
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    load_file = require("safetensors.torch").load_file
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:  # (a pickled pytorch_model.bin can run code when opened)
        raise FileNotFoundError(f"{folder} has no model.safetensors (nor its index.json)")
    weights = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: no {name}, a shard its index lists; download it")
        weights.update(load_file(folder / name, device=str(device)))
    return weights


def orthros_state_dict(weights, config, folder):
    """The weights as Orthros's state dict, identity scale-offsets (Alg. 1, line 5), or refused."""
    layer = {**LAYER, **(QKV_BIASES if config["qkv_bias"] else {}),
             **(QK_NORMS if config["qk_norm"] else {})}
    names = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f.weight",
             **({} if config["tie_embeddings"] else {"lm_head.weight": "lm_head.weight"})}
    for i in range(config["n_layer"]):
        names.update({f"model.layers.{i}.{hf}": f"blocks.{i}.{ours}" for hf, ours in layer.items()})
    missing = [name for name in names if name not in weights]
    if missing == ["lm_head.weight"]:
        raise ValueError(f"{folder}/config.json: tie_word_embeddings is false: no lm_head.weight")
    if missing:
        raise ValueError(f"{folder}: the weight {missing[0]} is missing from its safetensors files")
    # Old checkpoints carry RoPE's frequencies as a buffer; Orthros computes them.
    extra = [n for n in weights if n not in names and not n.endswith("rotary_emb.inv_freq")]
    if extra == ["lm_head.weight"] and not torch.equal(weights["lm_head.weight"],
                                                       weights["model.embed_tokens.weight"]):
        raise ValueError(f"{folder}/config.json: tie_word_embeddings is true, but lm_head.weight "
                         "differs from model.embed_tokens.weight")
    extra = [name for name in extra if name != "lm_head.weight"]
    if extra:
        qk_norm = any(f".{n}_norm." in extra[0] for n in "qk")
        what = ("QK-norm (a norm on queries and keys)" if qk_norm else
                "a bias" if extra[0].endswith(".bias") else "a weight")
        raise ValueError(f"{folder}: the weight {extra[0]} is {what} that Orthros does not have; "
                         "this model does not convert exactly")
    with torch.device("meta"):  # shapes only: no memory, no time
        own = Orthros(OrthrosConfig(**config)).state_dict()
    for hf, ours in names.items():
        if weights[hf].shape != own[ours].shape:
            raise ValueError(f"{folder}: the weight {hf} has shape {tuple(weights[hf].shape)}, but "
                             f"config.json implies {tuple(own[ours].shape)}")
    state = {ours: weights[hf] for hf, ours in names.items()}
    embedding = state["wte.weight"]
    for name, p in own.items():
        if name == "lm_head.weight" and config["tie_embeddings"]:
            state[name] = embedding
        elif identity_scale_offset(name) is not None:  # alpha = 1, beta = 0, in the weights' dtype
            state[name] = torch.full(p.shape, identity_scale_offset(name), dtype=embedding.dtype,
                                     device=embedding.device)
    return {name: state[name] for name in own}
