"""Exercise 9: the KV-cache decode step. Build Orthros.decode from the model's blocks.

After model.prefill(prompt) the cache (orthros.KVCache) holds, for each layer l, a LayerCache
cache.layers[l] with the keys and values of every position so far: .k, .v of shape
(B, n_kv_head, S, head_dim) after RoPE (n_kv_head = n_head unless the model has grouped-query
attention; head_dim = n_embd / n_head either way) (and .conv_state, the optional convolution's state, which
the block itself keeps); cache.length = S.

One decode step appends one token per sequence. Its base twin joins the cache and does
sliding-window attention; its output twin attends the whole cache; the LM head reads the output
twin. Write it with the model's blocks: block(z, T, rope, layer_cache) -> z, where z holds the
T base tokens then the output tokens, rope = (cos, sin) at the positions of z's rows (as
Orthros.forward makes them: orthros.rope_cos_sin with the config's rope_base and rope_scaling, in
the weights' dtype, from integer positions), and the block appends its T base tokens' keys and
values to layer_cache. Like model.decode, run it under torch.no_grad(): the cache keeps no graph.
The model's forward, prefill, decode and generate are refused while your code runs. The checker
compares yours with the model's own decode step (its logits, and the cache it leaves) after prefill(p) for p from 1 to 257, for
Orthros (with and without the convolution), SWA and the Transformer, with every option orthros.py
has (an untied head, grouped-query attention, Llama 3 RoPE scaling, no scale-offsets), in float64,
float32 and bfloat16 (keep the weights' dtype), batches of 1 to 3, next_idx of shape (B,) and
(B, 1), and on the meta device (the paper's widths): make new tensors where next_idx is, and leave
next_idx as it was.

    python -m exercises start 9       (your own copy: exercises/mine/ex09_decode_step.py)
    python -m exercises check 9       python -m exercises hint 9
"""

import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    """Append next_idx: (B,) or (B, 1), one token per sequence, to cache (a KVCache from
    model.prefill). Returns (logits, cache): logits (B, 1, vocab) predict the token after next_idx."""
    raise NotImplementedError
