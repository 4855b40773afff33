"""
Orthros: a minimal reference implementation of Orthros attention.

Paper: Chou et al., "Orthros: Phase-Aware Heterogeneous Attention for Efficient
Transformers" (2026), section 3, Algorithms 1 and 2, equations 4 and 5.

What Orthros changes versus a plain GPT:
  1. Every position i carries a *base token* x_i. The last t_out positions (those whose
     next token we predict) also carry an *output token* x'_i: a copy of the embedding
     that then evolves in its own residual stream (Alg. 2, line 2).
  2. Keys and values come from base tokens only (Alg. 1, line 4). They are the KV cache.
  3. Base tokens do causal sliding-window attention with window w (eq. 4); output tokens
     do full causal cross-attention over the same keys and values (eq. 5).
  4. Both streams share W_Q, W_K, W_V, W_O, the norms and the MLP. Only their queries
     differ, by an element-wise scale-offset: alpha * (x W_Q) + beta (Alg. 1, line 5).
  5. The LM head reads the output stream only (Alg. 2, lines 9-10).
Pre-training (t_out = T), SFT (t_out = response + 1), prefill (t_out = 1) and decoding
(one new token, t_out = 1) are the same forward pass with different t_out.

Choices of this implementation, not dictated by the paper:
  - a small modern GPT body: pre-norm RMSNorm, rotary position embeddings (RoPE), a GELU
    MLP of width 4C, no biases, input and output embeddings tied (as in nanoGPT);
  - the baselines share every line except attention: attn="transformer" is a plain GPT
    with full causal attention, attn="swa" uses the sliding window only;
  - sliding-window attention has a readable dense-mask reference (swa_impl="dense", O(T^2))
    and two fast paths whose cost grows linearly with T, both tested against it: blocks of w
    queries over 2w keys with plain SDPA ("blocked", the default on CPU) and FlexAttention
    ("flex", the default on CUDA). Training and prefill use the fast paths;
  - a naive KV cache (KVCache) grown by concatenation; compile_blocks() optionally fuses
    each block with torch.compile for speed;
  - an optional short causal depthwise convolution (conv_kernel > 0; off by default and
    in every paper configuration) mixes neighbouring base tokens before K and V, the same
    way for all three attn types. It only helps tiny models learn recall quickly.

How this file reads, top to bottom:
  1. the config, and the checks of the inputs the model accepts;
  2. the method: RoPE, the window (one predicate, in_window), the dense reference
     attention, Orthros attention (Alg. 1), MLP, Block, the KV cache, the model (Alg. 2)
     with prefill / decode / generate, and the conversion;
  then, marked as not in the paper, the optional short convolution;
  3. the fast paths: causal_attention, which picks the kernel; the sliding window in
     O(T w) (blocked SDPA, FlexAttention); the SDPA backend choice. They compute the same
     numbers as part 2 (the tests hold them to it): a first reading can stop before part 3.
"""

import functools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTN_TYPES = ("orthros", "transformer", "swa")
SWA_IMPLS = ("auto", "flex", "blocked", "dense")


# =============================================================================
# 1. The config, and the checks of what the model accepts
# =============================================================================

@dataclass
class OrthrosConfig:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768
    window: int = 128            # w, the sliding window (the paper always uses 128)
    attn: str = "orthros"        # "orthros" | "transformer" | "swa"
    scale_offset: bool = True    # False is the paper's "Orthros w/o SO" ablation
    max_seq_len: int = 2048      # longest sequence (prompt + generated) the model accepts
    rope_base: float = 10000.0
    dropout: float = 0.0
    conv_kernel: int = 0         # 0 = off; e.g. 3 for the tiny recall models (not in the paper)
    swa_impl: str = "auto"       # "auto" (flex on CUDA, else blocked) | "flex" | "blocked" | "dense"

    def __post_init__(self):
        if self.attn not in ATTN_TYPES:
            raise ValueError(f"unknown attn {self.attn!r}: choose one of {ATTN_TYPES}")
        if self.swa_impl not in SWA_IMPLS:
            raise ValueError(f"unknown swa_impl {self.swa_impl!r}: choose one of {SWA_IMPLS}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads "
                             "of an even size (RoPE rotates pairs of channels)")
        for name in ("vocab_size", "n_layer", "n_head", "window", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 0:
            raise ValueError(f"conv_kernel must be >= 0, got {self.conv_kernel}")


# -- What the model accepts: checks of its inputs, kept here so that part 2 reads as the method

def _check_idx(idx, config):
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(f"idx must have shape (B, T) with T >= 1, got {tuple(idx.shape)}")
    _check_length(idx.size(1), "sequence length", config)
    return idx.shape


def _check_length(length, what, config):
    if length > config.max_seq_len:
        raise ValueError(f"{what} = {length} exceeds max_seq_len={config.max_seq_len}; "
                         "shorten it or build the model with a larger max_seq_len")


def _check_t_out(t_out, T):
    if not isinstance(t_out, int) or not 1 <= t_out <= T:
        raise ValueError(f"t_out must be an int with 1 <= t_out <= T={T}, got {t_out!r}")
    return t_out


def _check_targets(targets, idx, t_out):
    if targets is not None and targets.shape != idx.shape:
        raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
    if targets is not None and (targets[:, :idx.size(1) - t_out] != -1).any():
        raise ValueError(f"targets before the last t_out={t_out} positions must be -1 "
                         "(ignored); raise t_out to cover every target you want trained")


def _check_cache(model, cache, next_idx):
    if not isinstance(cache, KVCache) or cache.model() is not model:
        raise ValueError("this cache was not made by this model's prefill(); "
                         "call model.prefill(prompt) on the same model first")
    if next_idx.size(0) != cache.batch_size:
        raise ValueError(f"decode got {next_idx.size(0)} tokens for a cache of batch size "
                         f"{cache.batch_size}: pass exactly one token per sequence")
    _check_length(cache.length + 1, "cache length after this decode step", model.config)


def _check_sampling(temperature, top_k):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no top-k), got {top_k}")


def _check_state_dict(own, state_dict):
    """Check that state_dict fits a model whose own state dict is own, but for Orthros's
    scale-offsets; return the names of those it lacks."""
    wrong = [k for k, w in state_dict.items() if k in own and own[k].shape != w.shape]
    if wrong:
        raise ValueError(f"state dict does not fit this model: {wrong[0]} has shape "
                         f"{tuple(state_dict[wrong[0]].shape)}, this model's is {tuple(own[wrong[0]].shape)}. "
                         "Is it from a model of another size?")
    missing = [k for k in own if k not in state_dict]
    bad_missing = [k for k in missing if k.rsplit(".", 1)[-1] not in ("alpha", "beta", "alpha_out", "beta_out")]
    unexpected = [k for k in state_dict if k not in own]
    if bad_missing or unexpected:
        raise ValueError(f"state dict does not fit this model: missing {bad_missing}, "
                         f"unexpected {unexpected}. Is it from a model of another size?")
    return missing


# =============================================================================
# 2. The method (paper section 3)
# =============================================================================

# -- Positions: rotary embeddings, and the one definition of the window -----------------

def rope_cos_sin(positions, head_dim, base, dtype):
    """The rotary tables cos, sin: each (len(positions), head_dim), in dtype. Channels i and
    i + D/2 form a pair that turns by the angle position * base^(-2i/D). The first half of
    sin is negated so that apply_rope is a single multiply-add."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]                 # (T, D/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x, cos, sin):
    """Rotate x: (B, H, T, D) by position: each pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


def in_window(q_pos, k_pos, window):
    """May a query at position q_pos attend a key at k_pos? The one definition of the window:
    the dense, blocked and FlexAttention masks are all built from it, looking it up at call
    time (a patched orthros.in_window applies to all), and a test holds the decode slice to it.
    Causal (k_pos <= q_pos), and with a window w also q_pos - k_pos < w: query t sees keys
    t-w+1 ... t, exactly w of them once t >= w-1 (eq. 4). window=None: all keys <= t (eq. 5)."""
    causal = k_pos <= q_pos
    return causal if window is None else causal & (q_pos - k_pos < window)


def attention_mask(n_q, n_k, window=None, device=None):
    """Boolean (n_q, n_k) mask, True where a query may attend a key.

    Queries are the *last* n_q of the n_k positions (bottom-right aligned), as they are for
    the output tokens and in decoding.
    NOTE: SDPA's is_causal=True aligns top-left when n_q < n_k, which is wrong here.
    """
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]   # (n_q, 1)
    k_pos = torch.arange(n_k, device=device)[None, :]              # (1, n_k)
    return in_window(q_pos, k_pos, window)


# -- Attention: the reference ---------------------------------------------------------------

def dense_sliding_window_attention(q, k, v, window, dropout_p=0.0):
    """The readable reference for eq. 4: attention through an explicit (Tq, Tk) mask, O(T^2).
    With window=None it is eq. 5, full causal attention. The model calls causal_attention
    (part 3), which computes the same numbers with the cheapest exact kernel.
    sdpa is F.scaled_dot_product_attention (kept off one GPU backend, part 3 says why)."""
    mask = attention_mask(q.size(-2), k.size(-2), window, q.device)
    return sdpa(q, k, v, mask, dropout_p=dropout_p)


# -- Algorithm 1: the Orthros attention layer -----------------------------------------------

class OrthrosAttention(nn.Module):
    """Algorithm 1 (attn="orthros"), and the two baselines that share its code."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.n_head, self.head_dim = config.n_head, C // config.n_head
        self.window = None if config.attn == "transformer" else config.window
        self.swa_impl, self.dropout = config.swa_impl, config.dropout
        # Alg. 1, line 2: W_Q, W_K, W_V, W_O, shared by base and output tokens.
        self.c_q = nn.Linear(C, C, bias=False)
        self.c_k = nn.Linear(C, C, bias=False)
        self.c_v = nn.Linear(C, C, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        # The scale-offsets of Alg. 1, line 5, one value per channel, starting at identity.
        # Only Orthros has them; a transformer state dict therefore loads with them at identity.
        self.scale_offset = config.attn == "orthros" and config.scale_offset
        if self.scale_offset:
            self.alpha = nn.Parameter(torch.ones(C))
            self.beta = nn.Parameter(torch.zeros(C))
            self.alpha_out = nn.Parameter(torch.ones(C))   # alpha' of the paper
            self.beta_out = nn.Parameter(torch.zeros(C))   # beta'
        self.conv = short_conv_weight(C, config.conv_kernel)  # not in the paper: None unless conv_kernel > 0

    def split_heads(self, x):  # (B, T, C) -> (B, H, T, D)
        return x.view(x.size(0), x.size(1), self.n_head, self.head_dim).transpose(1, 2)

    def forward(self, z, n_base, rope, past=None):
        """z: (B, n_base + n_out, C), normalized: n_base base tokens, then n_out output tokens
        (n_out = 0 for the baselines). rope: (cos, sin) at the positions of z's rows; an output
        token sits at its base twin's position. past: this layer's cached (k, v, conv_state),
        or None. Returns the output (B, n_base + n_out, C) and the updated (k, v, conv_state)."""
        B, L, C = z.shape
        n_out = L - n_base
        x = z[:, :n_base]          # Alg. 1, line 3: the base tokens; z[:, n_base:] are the output tokens

        x_kv, conv_state = short_conv(self.conv, x, past)  # not in the paper: x itself unless conv_kernel > 0
        k, v = self.c_k(x_kv), self.c_v(x_kv)              # Alg. 1, line 4: K, V from base tokens only
        q = self.c_q(z)                                    # Alg. 1, line 5: one W_Q for both streams,
        if self.scale_offset:                              # then distinct query transformations
            q = torch.cat([torch.addcmul(self.beta, self.alpha, q[:, :n_base]),              # alpha * q + beta
                           torch.addcmul(self.beta_out, self.alpha_out, q[:, n_base:])], dim=1)

        # Alg. 1, lines 6-7: split heads, then rotate queries and keys by their positions.
        cos, sin = rope
        q = apply_rope(self.split_heads(q), cos, sin)                       # (B, H, L, D)
        k = apply_rope(self.split_heads(k), cos[:n_base], sin[:n_base])     # (B, H, n_base, D)
        v = self.split_heads(v)                                             # (B, H, n_base, D)
        q, q_out = q.split([n_base, n_out], dim=2)
        if past is not None:  # the naive KV cache: append the new keys and values, keep everything
            k = torch.cat([past[0], k], dim=2)                              # (B, H, S, D)
            v = torch.cat([past[1], v], dim=2)

        dropout_p = self.dropout if self.training else 0.0
        # Alg. 1, line 8 (eq. 4): base tokens, sliding window (full causal for "transformer").
        # causal_attention (part 3) = dense_sliding_window_attention (above), by a faster kernel.
        y = causal_attention(q, k, v, self.window, self.swa_impl, dropout_p)
        if n_out > 0:
            # Alg. 1, line 9 (eq. 5): output tokens, full causal cross-attention to the same K, V.
            y_out = causal_attention(q_out, k, v, None, self.swa_impl, dropout_p)
            y = torch.cat([y, y_out], dim=2)                                # Alg. 1, line 11
        y = y.transpose(1, 2).reshape(B, -1, C)                             # Alg. 1, line 10: merge heads
        return self.c_proj(y), (k, v, conv_state)                           # Alg. 1, line 12: Y = O W_O


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One layer of Alg. 2 (lines 4-7). Norms and MLP are token-wise: they treat base and
    output tokens alike, with the same weights."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd)
        self.attn = OrthrosAttention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, z, n_base, rope, past=None):
        a, present = self.attn(self.ln_1(z), n_base, rope, past)
        z = z + self.drop(a)                                # Alg. 2, lines 4-5
        z = z + self.drop(self.mlp(self.ln_2(z)))           # Alg. 2, lines 6-7
        return z, present


# -- The KV cache ---------------------------------------------------------------------------

class KVCache:
    """The naive KV cache for incremental decoding of a batch of B sequences.

    Per layer l: k[l], v[l] of shape (B, n_head, S, head_dim), the keys and values (after
    RoPE) of all S positions seen so far; grown by concatenation, one token per decode step.
    Orthros keeps all S positions, not only the last w, because the output tokens'
    cross-attention reads them all. With conv_kernel > 0, conv[l] holds the last
    conv_kernel - 1 inputs of the convolution: (B, conv_kernel - 1, n_embd).
    """

    def __init__(self, model, batch_size):
        self.model = weakref.ref(model)  # so decode() can refuse a cache from another model
        self.batch_size = batch_size
        self.length = 0                  # S, the number of positions in the cache
        n = model.config.n_layer
        self.k, self.v, self.conv = [None] * n, [None] * n, [None] * n


# -- Algorithm 2: the model -----------------------------------------------------------------

class Orthros(nn.Module):
    """Algorithm 2: the Orthros Transformer (or a baseline, by config.attn)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, t_out=None):
        """idx: (B, T) token ids. t_out: how many of the last positions are output positions
        (None = T, pre-training). targets: (B, T), targets[:, t] is the token after idx[:, t],
        -1 = ignore; every target before the output positions must be -1.
        Returns logits (B, t_out, vocab) for the last t_out positions, and the mean
        cross-entropy over the non-ignored targets (None without targets)."""
        B, T = _check_idx(idx, self.config)
        t_out = _check_t_out(T if t_out is None else t_out, T)
        _check_targets(targets, idx, t_out)
        logits = self._forward(idx, t_out)
        if targets is None:
            return logits, None
        tgt = targets[:, T - t_out:]
        # sum / count rather than mean: a batch whose targets are all ignored gives 0, not NaN
        logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
        loss = F.cross_entropy(logits32.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                               ignore_index=-1, reduction="sum") / (tgt != -1).sum().clamp(min=1)
        return logits, loss

    def _forward(self, idx, t_out, cache=None):
        T = idx.size(1)
        start = cache.length if cache is not None else 0   # position of idx[:, 0]
        x = self.drop(self.wte(idx))                        # (B, T, C)
        positions = torch.arange(start, start + T, device=idx.device)
        if self.config.attn == "orthros":
            z = torch.cat([x, x[:, T - t_out:]], dim=1)     # Alg. 2, line 2: (B, T + t_out, C)
            positions = torch.cat([positions, positions[T - t_out:]])  # output tokens: their twins' positions
        else:
            z = x                                           # the baselines have one stream
        dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
            else self.wte.weight.dtype
        rope = rope_cos_sin(positions, self.config.n_embd // self.config.n_head, self.config.rope_base, dtype)
        for i, block in enumerate(self.blocks):             # Alg. 2, line 3
            past = (cache.k[i], cache.v[i], cache.conv[i]) if cache is not None and cache.length else None
            z, present = block(z, T, rope, past)
            if cache is not None:
                cache.k[i], cache.v[i], cache.conv[i] = present
        if cache is not None:
            cache.length += T
        # Alg. 2, line 9: keep the last t_out rows, which for Orthros are the output tokens
        # (never base tokens); for the baselines, the base tokens at the output positions.
        z = z[:, -t_out:]
        return self.lm_head(self.ln_f(z))                   # Alg. 2, line 10, then the LM head

    # -- Inference: prefill (T_in = T-1, T_out = 1), then decode one token at a time --------

    @torch.no_grad()
    def prefill(self, idx):
        """Run the prompt idx: (B, T). Returns the logits (B, 1, vocab) that predict token T,
        and a KVCache holding the keys and values of all T positions."""
        B, T = _check_idx(idx, self.config)
        cache = KVCache(self, B)
        return self._forward(idx, 1, cache), cache

    @torch.no_grad()
    def decode(self, next_idx, cache):
        """Append one token per sequence, next_idx: (B,) or (B, 1), to the cache. Its base twin
        joins the cache and does sliding-window attention; its output twin does full attention
        over the cache. Returns the logits (B, 1, vocab) for the following token."""
        next_idx = next_idx.reshape(-1, 1)                  # (B, 1)
        _check_cache(self, cache, next_idx)
        return self._forward(next_idx, 1, cache), cache

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, decoder=None):
        """Yield the max_new_tokens next tokens (B, 1) after the prompt idx: (B, T): the first right
        after prefill (the time to first token), then one per decode step, and no decode step after
        the last. temperature 0 is greedy; top_k keeps the k most likely tokens. decoder: any object
        with prefill(idx) -> (logits, state) and decode(next_idx, state) -> (logits, state);
        default self, the naive KV cache."""
        _check_sampling(temperature, top_k)
        _check_length(idx.size(1) + max_new_tokens, "prompt + max_new_tokens", self.config)
        decoder = self if decoder is None else decoder
        logits, state = decoder.prefill(idx)
        for step in range(max_new_tokens):
            next_idx = sample_next(logits, temperature, top_k)
            yield next_idx
            if step < max_new_tokens - 1:
                logits, state = decoder.decode(next_idx, state)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, decoder=None):
        """Extend idx: (B, T) by max_new_tokens tokens with prefill + decode (see generate_tokens)."""
        return torch.cat([idx, *self.generate_tokens(idx, max_new_tokens, temperature, top_k, decoder)], dim=1)

    # -- The paper's conversion (section 4.3) ------------------------------------------------

    def load_transformer_weights(self, state_dict):
        """Load a trained "transformer" (or Orthros) state dict. All shared weights have the same
        names; Orthros's extra scale-offset parameters are absent from a transformer and keep
        their identity initialisation: a pure weight copy."""
        missing = _check_state_dict(self.state_dict(), state_dict)  # the scale-offsets a transformer lacks
        self.load_state_dict(state_dict, strict=False)
        with torch.no_grad():
            for name in missing:  # identity scale-offset: q = 1 * (x W_Q) + 0
                self.get_parameter(name).fill_(1.0 if name.rsplit(".", 1)[-1].startswith("alpha") else 0.0)

    # -- Housekeeping ---------------------------------------------------------------------------

    def compile_blocks(self, **kwargs):
        """torch.compile every block, the model's hot loop, in place: it fuses RoPE, the
        scale-offsets, norms and residual adds into a few kernels. prefill, decode and generate
        stay plain Python around the compiled blocks."""
        for block in self.blocks:
            block.compile(**kwargs)
        return self

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def sample_next(logits, temperature=1.0, top_k=None):
    """The next token (B, 1) from logits (B, T, vocab) at the last position: greedy argmax at
    temperature 0, else sampled from softmax(logits / temperature), optionally from the top k."""
    logits = logits[:, -1, :].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


# =============================================================================
# Not in the paper: the optional short convolution (conv_kernel > 0)
# =============================================================================
# It mixes each base token with the K-1 before it, before K and V are projected; the same for
# all three attn types. Off (conv_kernel = 0) by default and in every paper configuration.
# OrthrosAttention calls it once (short_conv), and its weight is attn.conv.

def short_conv_weight(C, kernel_size):
    """The convolution's weight (C, 1, K), one filter per channel, starting as the identity
    (each token passes itself); None when kernel_size is 0."""
    if kernel_size == 0:
        return None
    weight = torch.zeros(C, 1, kernel_size)
    weight[:, 0, -1] = 1.0
    return nn.Parameter(weight)


def short_conv(weight, x, past):
    """Apply the convolution to the base tokens x: (B, T, C), continuing from the cached state
    past[2] when decoding. Returns (x itself, None) when weight is None."""
    if weight is None:
        return x, None
    state = past[2] if past is not None else x.new_zeros(x.size(0), weight.size(-1) - 1, x.size(-1))
    return causal_depthwise_conv(x, weight, state)


def causal_depthwise_conv(x, weight, state):
    """Short causal convolution over time, one filter per channel.

    x: (B, T, C), weight: (C, 1, K), state: (B, K-1, C), the K-1 inputs before x (zeros at
    the start). Returns the output (B, T, C) and the new state, the last K-1 inputs.
    """
    x = torch.cat([state, x], dim=1)
    y = F.conv1d(x.transpose(1, 2), weight, groups=x.size(-1)).transpose(1, 2)
    return y, x[:, x.size(1) - state.size(1):]


# =============================================================================
# 3. Fast paths: the same numbers as part 2, faster. Skip on a first reading.
# =============================================================================

def causal_attention(q, k, v, window=None, swa_impl="blocked", dropout_p=0.0):
    """dense_sliding_window_attention(q, k, v, window) of part 2, by the cheapest exact path.

    q: (B, H, Tq, D), k, v: (B, H, Tk, D); the queries are always the last Tq of the Tk key
    positions: base tokens (Tq = Tk, or 1 in decoding) and output tokens (the last t_out).
    """
    Tq, Tk = q.size(-2), k.size(-2)
    if Tq == 1:
        # The newest query, t = Tk-1, sees every key, or the last w of them (the keys
        # in_window(t, j, w) allows): a slice, no mask at all.
        # NOTE: q (a slice of both streams' queries) and the window of keys are strided views;
        # contiguous copies (tiny) keep SDPA on its fused kernels instead of a slow fallback.
        if window is not None:
            k, v = k[:, :, -window:].contiguous(), v[:, :, -window:].contiguous()
        return sdpa(q.contiguous(), k, v, dropout_p=dropout_p)
    if window is None or window >= Tk:
        if Tq == Tk:  # square: is_causal is right, and lets SDPA use its fastest kernels
            return sdpa(q, k, v, is_causal=True, dropout_p=dropout_p)
        return sdpa(q, k, v, attention_mask(Tq, Tk, None, q.device), dropout_p=dropout_p)
    assert Tq == Tk, "windowed attention runs over whole sequences (training/prefill) or one query"
    if swa_impl == "dense":
        return dense_sliding_window_attention(q, k, v, window, dropout_p)
    # FlexAttention for "flex" (and "auto" on CUDA); it has no attention dropout, so training
    # with dropout takes the blocked path.
    if (swa_impl == "flex" or (swa_impl == "auto" and q.is_cuda)) and dropout_p == 0.0:
        if torch.compiler.is_compiling():  # inside compile_blocks(): the few index ops fuse into the graph
            block_mask = sliding_window_block_mask(Tk, window, q.device)
        else:
            block_mask = cached_sliding_window_block_mask(Tk, window, q.device, torch.is_grad_enabled())
        return flex_sliding_window_attention(q, k, v, block_mask)
    return blocked_sliding_window_attention(q, k, v, window, dropout_p)


def sdpa(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """F.scaled_dot_product_attention, kept off the cuDNN backend unless the call is plain causal.

    NOTE: on Hopper GPUs, torch 2.11 sends bf16 SDPA to cuDNN by default. cuDNN builds a new
    plan for every new shape (tens of ms per decode step, where the cache grows by one key each
    time), and with explicit masks it has traps: fully masked rows are not zero, and gradients
    can be NaN for some key lengths (S % 128 == 64). The flash and memory-efficient kernels
    have none of these problems.
    """
    if q.is_cuda and not is_causal:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)


def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):
    """Eq. 4 in O(T w): the same result as the dense reference without the (T, T) mask.

    Cut the sequence into blocks of w queries. Every key a query of block b may see lies in
    block b-1 or block b, so each block attends its 2w keys through a small band mask.
    q, k, v: (B, H, T, D), the queries at the same T positions as the keys.
    """
    B, H, T, D = q.shape
    w = window
    n_blocks = math.ceil(T / w)
    pad = n_blocks * w - T
    # Pad the end to whole blocks, and give the keys one extra block in front that the mask
    # hides: block 0's "previous block".
    q = F.pad(q, (0, 0, 0, pad)).reshape(B * H, n_blocks, w, D)
    k = F.pad(k, (0, 0, w, pad)).reshape(B * H, n_blocks + 1, w, D)
    v = F.pad(v, (0, 0, w, pad)).reshape(B * H, n_blocks + 1, w, D)
    k = torch.cat([k[:, :-1], k[:, 1:]], dim=2)  # (B*H, n_blocks, 2w, D): previous + own block
    v = torch.cat([v[:, :-1], v[:, 1:]], dim=2)
    # Query i of block b sits at position b*w + i; key j of its 2w keys at (b-1)*w + j.
    blk = torch.arange(n_blocks, device=q.device)[:, None, None]
    q_pos = blk * w + torch.arange(w, device=q.device)[None, :, None]
    k_pos = (blk - 1) * w + torch.arange(2 * w, device=q.device)[None, None, :]
    mask = in_window(q_pos, k_pos, w) & (k_pos >= 0)               # (n_blocks, w, 2w)
    y = sdpa(q, k, v, mask, dropout_p=dropout_p)                    # (B*H, n_blocks, w, D)
    return y.reshape(B, H, n_blocks * w, D)[:, :, :T]


def sliding_window_block_mask(T, window, device, block_size=128, compute_q_blocks=None):
    """The FlexAttention BlockMask of eq. 4, from block-index tables of O(T / block_size) size,
    never a (T, T) tensor. Query block b reads key blocks first[b] ... b, those that hold
    positions b*128 - w + 1 ... b*128 + 127; mask_mod (in_window) then trims them to the exact
    window. compute_q_blocks (default: torch.is_grad_enabled()) adds the transposed table that
    the backward pass reads: key block c is read by query blocks c ... last[c]."""
    from torch.nn.attention.flex_attention import BlockMask
    compute_q_blocks = torch.is_grad_enabled() if compute_q_blocks is None else compute_q_blocks
    n = math.ceil(T / block_size)
    width = min(n, math.ceil((window - 1) / block_size) + 1)  # the most blocks any row reads
    blocks = torch.arange(n, device=device)
    first = ((blocks * block_size - window + 1) // block_size).clamp(min=0)
    last = ((blocks * block_size + block_size + window - 2) // block_size).clamp(max=n - 1)

    def table(start, stop):  # rows of consecutive block indices: counts (1, 1, n), indices (1, 1, n, width)
        indices = (start[:, None] + torch.arange(width, device=device)).clamp(max=n - 1)
        return (stop - start + 1).int()[None, None], indices.int()[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return in_window(q_idx, kv_idx, window)  # looked up at call time: a patched in_window applies

    kv_num_blocks, kv_indices = table(first, blocks)
    if torch.device(device).type == "cpu":
        # NOTE: torch 2.13's Inductor CPU lowering of flex_attention asserts that the table is
        # ceil(T/128) columns wide, though its kernel, like the CUDA kernels, reads only the first
        # kv_num_blocks entries of each row. Hand it an (n, n) view of the narrow rows' storage
        # (plus n spare entries) rather than an O(n^2) copy; the columns past a row's count are
        # never read. BlockMask.to_dense() assumes a full-width table: don't use it on these masks.
        storage = torch.cat([kv_indices.flatten(), kv_indices.new_zeros(n)])
        kv_indices = storage.as_strided((1, 1, n, n), (n * width, n * width, width, 1))
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(T, T), compute_q_blocks=False)
    if compute_q_blocks:
        # torch's own transpose (compute_q_blocks=True) needs a full-width table: build ours.
        mask.q_num_blocks, mask.q_indices = table(blocks, last)
    return mask


@functools.lru_cache(maxsize=8)
def cached_sliding_window_block_mask(T, window, device, grad_enabled):
    """sliding_window_block_mask, built once per (T, window, device, grad mode) and reused by
    every layer and every call with that shape."""
    return sliding_window_block_mask(T, window, device, compute_q_blocks=grad_enabled)


_compiled_flex_attention = None


def flex_sliding_window_attention(q, k, v, block_mask):
    """Eq. 4 with FlexAttention: a fused kernel that skips the key blocks outside the window.
    FlexAttention is fast only when compiled; outside torch.compile we call a compiled copy."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask)
