"""
FLOP counts of one forward pass of the three attentions, from the model's config (one multiply-add
= 2 FLOPs; norms, RoPE, softmax, activations and the embedding lookup are left out: a few percent).
perf/bench.py's FLOP limits and MFU, train.py's MFU on CUDA, and exercise 7's reference use them.
"""

import dataclasses

import torch


# exercises/solutions/ex07_prefill_flops.py holds a copy of attended_pairs: the exercise's answer.
def attended_pairs(T, window=None, n_q=None):
    """Number of (query, key) pairs a causal attention over T positions computes, for its last
    n_q queries (default all T), each seeing at most `window` keys (None = all keys <= itself)."""
    n_q = T if n_q is None else n_q
    if window is None:  # query at position t sees t + 1 keys, for t = T - n_q .. T - 1
        return n_q * T - n_q * (n_q - 1) // 2
    assert n_q == T, "windowed attention runs over whole sequences"
    w = min(window, T)  # the first w queries see 1, 2, ..., w keys; every later one sees w
    return w * (w + 1) // 2 + (T - w) * window


def forward_flops(cfg, T, t_out, lm_head_tokens=None):
    """FLOPs of one forward over one sequence of T tokens whose last t_out are output positions
    (pre-training t_out = T, prefill t_out = 1), for cfg.attn. Per layer:
      token-wise: W_Q, W_O (2 C C_q, C_q = n_head * head_dim: C unless head_dim says otherwise) and
        the MLP (8C^2 by default) on every token that flows through the layer (Orthros: T base +
        t_out output tokens), W_K, W_V (2 C C_q, less with grouped-query attention) on the T base
        tokens only;
      attention: QK^T and PV, 2 * 2 * C_q FLOPs per (query, key) pair;
        Transformer: causal, T(T+1)/2 pairs; SWA and Orthros's base tokens: <= w keys per query;
        Orthros's output tokens: full causal cross-attention of its t_out queries.
    Plus the LM head, 2 C V per position with logits (t_out of them: prefill returns 1)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    D = getattr(cfg, "head_dim", None) or C // cfg.n_head
    C_q, kv_width = D * cfg.n_head, D * (getattr(cfg, "n_kv_head", None) or cfg.n_head)
    hidden = getattr(cfg, "mlp_hidden", None) or 4 * C
    mlp = (3 if getattr(cfg, "mlp", "gelu") == "swiglu" else 2) * C * hidden
    n_tokens = T + t_out if cfg.attn == "orthros" else T
    tokenwise = 2 * ((2 * C * C_q + mlp) * n_tokens + 2 * C * kv_width * T)
    if cfg.attn == "transformer":
        pairs = attended_pairs(T)
    else:
        pairs = attended_pairs(T, cfg.window)
        if cfg.attn == "orthros":
            pairs += attended_pairs(T, None, n_q=t_out)
    lm_head = 2 * C * V * (t_out if lm_head_tokens is None else lm_head_tokens)
    return L * (tokenwise + 4 * C_q * pairs) + lm_head


def prefill_flop_limits(cfg, T, attn):
    """The best prefill speedup over the Transformer that FLOP counts allow: FLOPs(Transformer) /
    FLOPs(attn), both prefilling T tokens with logits at the last one only (as prefill() computes
    them: the true limit for this code), and the same with the LM head counted on all T tokens
    (the usual "2 x params per token" count, more conservative). At the bench's size (12 x 768,
    w=128, V=50304): 4.4x / 14.8x / 28.6x at 32K / 128K / 256K, and 3.38x / 10.57x / 20.16x."""
    ref, mine = dataclasses.replace(cfg, attn="transformer"), dataclasses.replace(cfg, attn=attn)
    ratio = lambda head: forward_flops(ref, T, 1, head) / forward_flops(mine, T, 1, head)
    return ratio(None), ratio(T)


def train_flops(cfg, T, batch, t_out=None):
    """FLOPs of one training step of `batch` sequences: forward + backward (2x forward). With
    t_out = T (pre-training, the default) Orthros's forward does token-wise work on 2T tokens (K, V
    on T), SWA for T base queries, causal cross-attention for T output queries, the LM head on T."""
    return 3 * batch * forward_flops(cfg, T, T if t_out is None else t_out)


def peak_flops(device):
    """The GPU's dense bf16 peak FLOP/s (vendors' figures), for MFU: forward_flops' count per second
    over this. None on a CPU and on a GPU not in the table (then no MFU is reported)."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    tflops = {"H100": 989, "H200": 989, "B200": 2250, "A100": 312}
    return next((1e12 * peak for gpu, peak in tflops.items() if gpu in name), None)
