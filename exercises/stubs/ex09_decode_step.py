"""Exercise 9: the KV-cache decode step. Build Orthros.decode from the model's blocks.

After model.prefill(prompt) the cache (orthros.KVCache) holds cache.length = S and, for each layer
l, cache.layers[l] with the keys and values of every position so far: .k, .v (B, n_kv_head, S,
head_dim) after RoPE (and .conv_state, which the block keeps).

One decode step appends one token per sequence: its base twin joins the cache and attends its
window, its output twin attends the whole cache, and the LM head reads the output twin. Write it
with block(z, T, rope, layer_cache) -> z: z holds the T base tokens, then the output tokens; rope
= (cos, sin) at z's rows' positions (orthros.rope_cos_sin as Orthros.forward calls it); the block
appends its base tokens' keys and values to layer_cache. Like model.decode, run under
torch.no_grad() (forward, prefill, decode and generate are refused). The checker compares yours
with the model's decode (logits, and the cache it leaves) after prefill(p), p up to 257, for
Orthros, SWA and the Transformer with every option orthros.py has, in float64, float32 and
bfloat16 (keep the weights'), next_idx (B,) or (B, 1), and on the meta device (the paper's
widths): make new tensors where next_idx is, and leave next_idx as it was.
"""

import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    """Append next_idx, (B,) or (B, 1), to cache (a KVCache from model.prefill). Returns (logits,
    cache): logits (B, 1, vocab) predict the token after next_idx."""
    raise NotImplementedError
