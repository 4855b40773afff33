"""Exercise 9: the KV-cache decode step. Build Orthros.decode from the model's modules.

After model.prefill(prompt) the cache (orthros.KVCache) holds, for each layer l, the keys and values
of every position so far: cache.k[l], cache.v[l] of shape (B, n_head, S, head_dim) after RoPE,
cache.conv[l] (the optional convolution's state; None unless conv_kernel > 0), and cache.length = S.

One decode step appends one token per sequence. Its base twin joins the cache and does
sliding-window attention; its output twin attends the whole cache; the LM head reads the output
twin. Write it with the model's blocks: block(z, n_base, rope, past) -> (z, present), where
past = (cache.k[l], cache.v[l], cache.conv[l]) and present is that layer's updated
(k, v, conv_state). model.decode and model._forward are unavailable here: the checker makes them
raise. The checker runs prefill(p) and then your steps, and compares the logits with ONE training
forward over the whole sequence (train == decode, float64, to 1e-10), for several p, for Orthros
(with and without the convolution) and SWA; and it checks that the cache keeps every position.

    python -m exercises check 9       python -m exercises hint 9
"""

import torch

from orthros import rope_cos_sin


def decode_step(model, next_idx, cache):
    """Append next_idx: (B,) or (B, 1), one token per sequence, to cache (a KVCache from
    model.prefill). Returns (logits, cache): logits (B, 1, vocab) predict the token after next_idx."""
    raise NotImplementedError
