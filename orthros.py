"""
Orthros: a minimal reference implementation of Orthros attention.

Paper: Chou et al., "Orthros: Phase-Aware Heterogeneous Attention for Efficient
Transformers" (2026), section 3, Algorithms 1 and 2, equations 4 and 5.

What Orthros changes versus a plain GPT:
  1. Every position carries a *base token*. The last t_out positions (those whose next token
     we predict) also carry an *output token*: a copy of the embedding that then evolves in
     its own residual stream (Alg. 2, line 2).
  2. Keys and values come from base tokens only (Alg. 1, line 4). They are the KV cache.
  3. Base tokens do causal sliding-window attention with window w (eq. 4); output tokens
     do full causal cross-attention over the same keys and values (eq. 5).
  4. Both streams share W_Q, W_K, W_V, W_O, the norms and the MLP. Only their queries
     differ, by an element-wise scale-offset: alpha * (x W_Q) + beta (Alg. 1, line 5).
  5. The LM head reads the output stream only (Alg. 2, lines 9-10).
Pre-training (t_out = T), SFT (t_out = response + 1), prefill (t_out = 1) and decoding (one
new token, T = t_out = 1) are the same forward pass with different T and t_out.

Choices of this implementation, not dictated by the paper: pre-norm RMSNorm, rotary position
embeddings (RoPE), a GELU MLP of width 4C, no biases, tied input and output embeddings (as in
nanoGPT). The baselines share every line but attention: attn="transformer" is a plain GPT,
attn="swa" uses the sliding window only. scale_offset=False is the paper's "w/o SO" ablation.
For pretrained Llama-architecture models to convert exactly (convert/hf.py), the config also has
grouped-query attention, SwiGLU, an untied head, RMSNorm's eps, Llama 3's RoPE scaling, Q/K/V
biases, Qwen3's RMSNorm of each query and key head (qk_norm), and heads of any width (head_dim).

How this file reads, top to bottom:
  1. the method: the config, RoPE, the window (one predicate, in_window), the reference
     attention softmax(Q K^T / sqrt(D) + mask) V, Orthros attention (Alg. 1), MLP, Block, the
     naive KV cache, and the model (Alg. 2) with prefill, decode, generate and the conversion;
  2. sampling the next token, the checks of what the model accepts, two helpers of the options
     for converted models (repeat_kv, llama3_inv_freq), and one thing not in the paper: an
     optional short convolution before K and V (off by default; it helps tiny models learn recall);
  3. the fast paths: the same numbers as the reference attention by faster kernels (the
     window in O(T w) with plain SDPA or FlexAttention), and torch.compile. The tests hold
     them to part 1: a first reading can stop before part 3.
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
MLP_TYPES = ("gelu", "swiglu")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
SCALE_OFFSETS = ("alpha", "beta", "alpha_out", "beta_out")  # of every layer (Alg. 1, line 5)
IGNORE = -1  # the target of a position that is not trained (cross_entropy's ignore_index)


# =============================================================================
# 1. The method (paper section 3)
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
    conv_kernel: int = 0         # not in the paper (part 2): 0 = off; 3 for the tiny recall models
    swa_impl: str = "auto"       # the attention's kernel: "dense" = the reference; the rest: part 3
    n_kv_head: int | None = None      # grouped-query attention: K, V heads (None = n_head)
    mlp: str = "gelu"                 # "gelu" | "swiglu" (Llama's gated MLP)
    mlp_hidden: int | None = None     # the MLP's hidden width (None = 4 * n_embd)
    tie_embeddings: bool = True       # the LM head is the input embedding (False: its own)
    norm_eps: float | None = None     # RMSNorm's epsilon (None = torch's default, the dtype's eps)
    rope_scaling: dict | None = None  # None, or Llama 3's {"rope_type": "llama3", ...} (part 2)
    qkv_bias: bool = False            # biases on W_Q, W_K, W_V (Qwen2 has them)
    qk_norm: bool = False             # RMSNorm of each query and key head, before RoPE (Qwen3)
    head_dim: int | None = None       # each head's width (None = n_embd // n_head; Qwen3-0.6B: 128)

    def __post_init__(self):
        _check_config(self)


# -- Positions: rotary embeddings, and the one definition of the window -----------------

def rope_cos_sin(positions, head_dim, base, dtype=torch.float32, scaling=None):
    """The rotary tables cos, sin: (len(positions), head_dim). Channels i and i + D/2 turn by the
    angle position * base^(-2i/D), slowed by Llama 3's scaling if given (part 2); sin's first half
    is negated so apply_rope is one multiply-add."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    inv_freq = inv_freq if scaling is None else llama3_inv_freq(inv_freq, scaling)
    angles = positions.float()[:, None] * inv_freq[None, :]                 # (T, D/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x, cos, sin):
    """Rotate x: (B, H, T, D) by position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


def in_window(q_pos, k_pos, window):
    """May a query at position q_pos attend a key at k_pos? Causal, and with a window w also
    q_pos - k_pos < w: query t sees keys t-w+1 ... t (eq. 4); window=None: all keys <= t (eq. 5).
    Every mask in this file, and in the fast decoder, is built from this one predicate."""
    causal = k_pos <= q_pos
    return causal if window is None else causal & (q_pos - k_pos < window)


def attention_mask(n_q, n_k, window=None, device=None):
    """Boolean (n_q, n_k), True where a query may attend a key. The queries are the *last* n_q
    of the n_k positions, as output tokens and decoded tokens are.
    NOTE: SDPA's is_causal=True aligns top-left when n_q < n_k, which is wrong here."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]   # (n_q, 1)
    k_pos = torch.arange(n_k, device=device)[None, :]              # (1, n_k)
    return in_window(q_pos, k_pos, window)


def reference_attention(q, k, v, window=None, dropout_p=0.0):
    """Eq. 4 (window w) or eq. 5 (window=None) written out: softmax(Q K^T / sqrt(D) + M) V, with
    M = 0 where in_window allows a key, else -inf. q: (B, H, Tq, D) at the last Tq of the Tk
    positions of k, v: (B, H, Tk, D). O(Tq Tk): the model gets the same numbers faster (part 3)."""
    allowed = attention_mask(q.size(-2), k.size(-2), window, q.device)     # (Tq, Tk)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))               # (B, H, Tq, Tk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = F.dropout(torch.softmax(scores, dim=-1), dropout_p)
    return weights @ v                                                     # (B, H, Tq, D)


# -- Algorithm 1: the Orthros attention layer -----------------------------------------------

class OrthrosAttention(nn.Module):
    """Algorithm 1 (attn="orthros"), and the two baselines that share its code."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.n_head, self.head_dim = config.n_head, config.head_dim or C // config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head   # grouped-query attention: fewer K, V
        C_q, C_kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim  # C_q: C by default
        self.window = None if config.attn == "transformer" else config.window
        self.swa_impl, self.dropout = config.swa_impl, config.dropout
        # Alg. 1, line 2: W_Q, W_K, W_V, W_O, shared by base and output tokens.
        self.c_q = nn.Linear(C, C_q, bias=config.qkv_bias)
        self.c_k = nn.Linear(C, C_kv, bias=config.qkv_bias)
        self.c_v = nn.Linear(C, C_kv, bias=config.qkv_bias)
        self.c_proj = nn.Linear(C_q, C, bias=False)
        norm = lambda: nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.q_norm, self.k_norm = norm(), norm()   # qk_norm: a gain per channel of a head
        # The scale-offsets of Alg. 1, line 5: one value per channel, starting at identity.
        self.scale_offset = config.attn == "orthros" and config.scale_offset
        if self.scale_offset:
            self.alpha = nn.Parameter(torch.ones(C_q))
            self.beta = nn.Parameter(torch.zeros(C_q))
            self.alpha_out = nn.Parameter(torch.ones(C_q))   # alpha' of the paper
            self.beta_out = nn.Parameter(torch.zeros(C_q))   # beta'
        # Not in the paper (part 2): a short convolution before K and V, when conv_kernel > 0.
        self.conv = ShortConv(C, config.conv_kernel) if config.conv_kernel else None

    def split_heads(self, x):  # (B, rows, heads * D) -> (B, heads, rows, D)
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def head_norm(self, x, norm):  # (B, rows, heads * D): RMSNorm of each head's D channels
        return x if norm is None else norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)

    def forward(self, z, T, rope, cache=None):
        """z: (B, T + t_out, C): T base tokens, then t_out output tokens (none for the baselines).
        rope: (cos, sin) at the positions of z's rows, an output token at its base twin's.
        cache: this layer's LayerCache when decoding. Returns (B, T + t_out, C)."""
        x, x_out = z[:, :T], z[:, T:]        # Alg. 1, line 3: base tokens X, output tokens X_cross
        x_kv = x if self.conv is None else self.conv(x, cache)
        k, v = self.c_k(x_kv), self.c_v(x_kv)   # Alg. 1, line 4: K, V from base tokens only
        q, q_out = self.c_q(x), self.c_q(x_out)
        # qk_norm: the scale-offset acts after the head norm, which would undo its scale (an alpha
        # common to a head's channels) if it came first; at alpha = 1, beta = 0 it is the identity,
        # so a converted model computes what the original did.
        q, q_out = self.head_norm(q, self.q_norm), self.head_norm(q_out, self.q_norm)
        k = self.head_norm(k, self.k_norm)
        if self.scale_offset:                   # Alg. 1, line 5: distinct query transformations
            q, q_out = self.alpha * q + self.beta, self.alpha_out * q_out + self.beta_out
        # Alg. 1, lines 6-7: split heads, then rotate queries and keys by their positions.
        cos, sin = rope
        q = apply_rope(self.split_heads(q), cos[:T], sin[:T])            # (B, H, T, D)
        q_out = apply_rope(self.split_heads(q_out), cos[T:], sin[T:])    # (B, H, t_out, D)
        k = apply_rope(self.split_heads(k), cos[:T], sin[:T])            # (B, n_kv_head, T, D)
        v = self.split_heads(v)
        if cache is not None:   # decoding: attend every key and value seen so far
            k, v = cache.append(k, v)                                    # (B, n_kv_head, S, D)
        k, v = repeat_kv(k, self.n_head), repeat_kv(v, self.n_head)      # (B, H, S, D)
        dropout_p = self.dropout if self.training else 0.0
        # The one switch of kernels, as nanoGPT's flash-or-manual: "dense" runs reference_attention,
        # eqs. 4-5 as written above; every other swa_impl gives the same by faster kernels (part 3).
        if self.swa_impl == "dense":
            attention = reference_attention
        else:
            attention = functools.partial(fast_reference_attention, swa_impl=self.swa_impl)
        o = attention(q, k, v, self.window, dropout_p=dropout_p)         # Alg. 1, line 8 (eq. 4)
        o_out = attention(q_out, k, v, None, dropout_p=dropout_p)        # Alg. 1, line 9 (eq. 5)
        merge = lambda o: o.transpose(1, 2).flatten(2)                   # -> (B, rows, H * D)
        o, o_out = merge(o), merge(o_out)                                # Alg. 1, line 10
        o = torch.cat([o, o_out], dim=1)              # Alg. 1, line 11: (B, T + t_out, H * D)
        return self.c_proj(o)                                            # Alg. 1, line 12


class MLP(nn.Module):
    """GELU (GPT-2's), or SwiGLU (Llama's): c_proj(silu(c_gate(x)) * c_fc(x))."""

    def __init__(self, config):
        super().__init__()
        C, hidden = config.n_embd, config.mlp_hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(C, hidden, bias=False)
        self.c_gate = nn.Linear(C, hidden, bias=False) if config.mlp == "swiglu" else None
        self.c_proj = nn.Linear(hidden, C, bias=False)

    def forward(self, x):
        if self.c_gate is None:
            return self.c_proj(F.gelu(self.c_fc(x)))
        return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))


class Block(nn.Module):
    """One layer of Alg. 2 (lines 4-7). Norms and MLP are token-wise: the same for both streams."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = OrthrosAttention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, z, T, rope, cache=None):
        z = z + self.drop(self.attn(self.ln_1(z), T, rope, cache))   # Alg. 2, lines 4-5
        z = z + self.drop(self.mlp(self.ln_2(z)))                    # Alg. 2, lines 6-7
        return z


class LayerCache:
    """The naive KV cache of one layer: keys and values (after RoPE) of all S positions so far,
    (B, n_kv_head, S, D). Not only the last w: the output tokens' cross-attention reads them all.
    conv_state: the optional convolution's last inputs (part 2), None without one."""
    k = v = conv_state = None

    def append(self, k, v):
        """Append the new positions' k, v: (B, H, T, D); return all of them: (B, H, S + T, D)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    """The naive KV cache of a batch of B sequences: a LayerCache per layer; length = S."""

    def __init__(self, model, batch_size):
        self.layers = [LayerCache() for _ in model.blocks]
        self.length, self.batch_size = 0, batch_size
        self.model = weakref.ref(model)   # the model whose prefill made it


# -- Algorithm 2: the model -----------------------------------------------------------------

class Orthros(nn.Module):
    """Algorithm 2: the Orthros Transformer (or a baseline, by config.attn)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # as in nanoGPT (a converted model may have a head of its own)
            self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's init (nanoGPT's: the tied embedding drawn twice)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():  # then the residual projections, scaled down
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets=None, t_out=None, cache=None):
        """idx: (B, T) token ids; the last t_out positions are output positions (None = T).
        targets: (B, T), the token after each position, IGNORE (-1) = not trained (all before the
        output positions: check_targets). cache: the KVCache that idx continues (prefill, decode, or
        a chunk of any length). Returns the logits (B, t_out, vocab) and the mean cross-entropy over
        the targets that are not IGNORE (or None)."""
        T, t_out = _check_inputs(self, idx, targets, t_out, cache)
        positions = torch.arange(T, device=idx.device) + (cache.length if cache is not None else 0)
        z = x = self.drop(self.wte(idx))                    # (B, T, C): the baselines' one stream
        if self.config.attn == "orthros":
            z = torch.cat([x, x[:, T - t_out:]], dim=1)     # Alg. 2, line 2: (B, T + t_out, C)
            positions = torch.cat([positions, positions[T - t_out:]])   # at their twins'
        rope = rope_cos_sin(positions, self.blocks[0].attn.head_dim, self.config.rope_base,
                            activation_dtype(self.wte.weight), self.config.rope_scaling)
        for i, block in enumerate(self.blocks):             # Alg. 2, line 3
            z = block(z, T, rope, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.length += T
        # Alg. 2, line 9: keep the last t_out rows, which for Orthros are the output tokens
        # (never base tokens); for the baselines, the base tokens at the output positions.
        logits = self.lm_head(self.ln_f(z[:, -t_out:]))     # Alg. 2, line 10, then the LM head
        loss = None if targets is None else cross_entropy(logits, targets[:, T - t_out:])
        return logits, loss

    # -- Inference: prefill (T_in = T-1, T_out = 1), then decode one token at a time --------

    @torch.no_grad()
    def prefill(self, idx):
        """The prompt idx: (B, T) -> the logits (B, 1, vocab) for token T, and the KVCache of all T
        positions."""
        cache = KVCache(self, idx.size(0))
        return self(idx, t_out=1, cache=cache)[0], cache

    @torch.no_grad()
    def decode(self, next_idx, cache):
        """One new token per sequence, next_idx: (B,) or (B, 1): its base twin joins the cache and
        does SWA, its output twin attends the whole cache. Returns logits (B, 1, vocab), cache."""
        return self(next_idx.reshape(-1, 1), t_out=1, cache=cache)[0], cache

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, decoder=None):
        """Yield max_new_tokens tokens (B, 1) after the prompt idx: (B, T), the first right after
        prefill, then one per decode step. temperature 0 is greedy; top_k keeps the k likeliest.
        decoder: has prefill(idx) and decode(next_idx, state), each -> (logits, state) (default: the
        model's own)."""
        _check_generation(self.config, idx, max_new_tokens, temperature, top_k)
        decoder = self if decoder is None else decoder
        logits, state = decoder.prefill(idx)
        for step in range(max_new_tokens):
            next_idx = sample_next(logits, temperature, top_k)
            yield next_idx
            if step < max_new_tokens - 1:
                logits, state = decoder.decode(next_idx, state)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, decoder=None):
        """idx: (B, T) followed by max_new_tokens tokens from generate_tokens."""
        tokens = self.generate_tokens(idx, max_new_tokens, temperature, top_k, decoder)
        return torch.cat([idx, *tokens], dim=1)

    def load_transformer_weights(self, state_dict):
        """The paper's conversion (section 4.3): load a trained "transformer" (or Orthros) state
        dict. Shared weights have the same names; the scale-offsets a transformer lacks start at
        identity. A pure weight copy."""
        missing = _check_state_dict(self.state_dict(), state_dict)  # what a transformer lacks
        self.load_state_dict(state_dict, strict=False)
        with torch.no_grad():
            for name in missing:
                self.get_parameter(name).fill_(identity_scale_offset(name))


def identity_scale_offset(name):
    """The identity value of a state-dict entry that is a scale-offset (Alg. 1, line 5, as
    q = 1 * (x W_Q) + 0): 1.0 for alpha and alpha_out, 0.0 for beta and beta_out; else None."""
    kind = name.rsplit(".", 1)[-1]
    return None if kind not in SCALE_OFFSETS else 1.0 if kind.startswith("alpha") else 0.0


# =============================================================================
# 2. Sampling, the checks of what the model accepts, and one thing not in the paper
# =============================================================================

def sample_next(logits, temperature=1.0, top_k=None):
    """The next token (B, 1) from logits (B, T, vocab) at the last position: the argmax at
    temperature 0, else a draw from p = softmax(logits / temperature) (of the top k) by the
    exponential race: argmax_i p_i / E_i, E_i ~ Exp(1), is i with probability p_i. No GPU sync:
    perf/engine.py draws inside its CUDA graph."""
    logits = logits[:, -1, :].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    race = F.softmax(logits, dim=-1) / torch.empty_like(logits).exponential_()
    return race.argmax(dim=-1, keepdim=True)


def cross_entropy(logits, targets):
    """The mean cross-entropy (in float32 at least) over the targets that are not IGNORE; 0, not
    NaN, when all are."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    return loss / (targets != IGNORE).sum().clamp(min=1)


def _check_config(config):
    for name, choices in (("attn", ATTN_TYPES), ("swa_impl", SWA_IMPLS), ("mlp", MLP_TYPES)):
        if getattr(config, name) not in choices:
            raise ValueError(f"unknown {name} {getattr(config, name)!r}: choose one of {choices}")
    uneven = config.head_dim is None and config.n_embd % config.n_head
    if uneven or (config.head_dim or config.n_embd // config.n_head) % 2:
        raise ValueError(f"n_embd={config.n_embd} must split into n_head={config.n_head} heads "
                         "of an even size (RoPE rotates pairs of channels), or head_dim be even")
    for name in ("vocab_size", "n_layer", "n_head", "window", "max_seq_len", "n_kv_head",
                 "mlp_hidden", "head_dim"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.n_head % (config.n_kv_head or config.n_head):
        raise ValueError(f"n_kv_head={config.n_kv_head} must divide n_head={config.n_head} "
                         "(each K, V head serves an equal group of query heads)")
    scaling = config.rope_scaling
    llama3 = isinstance(scaling, dict) and scaling.get("rope_type") == "llama3"
    if scaling is not None and not (llama3 and set(LLAMA3_ROPE_KEYS) <= set(scaling)):
        raise ValueError(f"rope_scaling must be None or Llama 3's dict, {{'rope_type': 'llama3'}} "
                         f"with {', '.join(LLAMA3_ROPE_KEYS)}; got {scaling!r}")
    if config.conv_kernel < 0:
        raise ValueError(f"conv_kernel must be >= 0, got {config.conv_kernel}")


def _check_length(length, what, config):
    if length > config.max_seq_len:
        raise ValueError(f"{what} = {length} exceeds max_seq_len={config.max_seq_len}; "
                         "shorten it or build the model with a larger max_seq_len")


def _check_inputs(model, idx, targets, t_out, cache):
    """Orthros.forward's checks: returns (T, t_out)."""
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(f"idx must have shape (B, T) with T >= 1, got {tuple(idx.shape)}")
    T = idx.size(1)
    t_out = T if t_out is None else t_out
    if not isinstance(t_out, int) or not 1 <= t_out <= T:
        raise ValueError(f"t_out must be an int with 1 <= t_out <= T={T}, got {t_out!r}")
    if targets is not None and targets.shape != idx.shape:
        raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, "
                         f"got {tuple(targets.shape)}")
    if targets is not None and targets.device.type == "cpu":  # on a GPU: see check_targets
        check_targets(targets, t_out)
    if cache is not None and (not isinstance(cache, KVCache) or cache.model() is not model):
        raise ValueError("this cache was not made by this model's prefill(); "
                         "call model.prefill(prompt) on the same model first")
    if cache is not None and idx.size(0) != cache.batch_size:
        raise ValueError(f"idx has {idx.size(0)} rows for a cache of batch size "
                         f"{cache.batch_size}: continue each cached sequence, one row each")
    length = T + (cache.length if cache is not None else 0)
    _check_length(length, "sequence length (with the cache)", model.config)
    return T, t_out


def check_targets(targets, t_out):
    """Refuse targets (B, T) that the loss would drop: any but IGNORE before the last t_out
    positions. NOTE: reading them on a GPU makes the CPU wait: forward checks CPU targets only;
    data/sft.py checks its batches before they move."""
    if (targets[:, :targets.size(1) - t_out] != IGNORE).any():
        raise ValueError(f"targets before the last t_out={t_out} positions must be {IGNORE} "
                         "(ignored); raise t_out to cover every target you want trained")


def _check_generation(config, idx, max_new_tokens, temperature, top_k):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no top-k), got {top_k}")
    _check_length(idx.size(1) + max_new_tokens, "prompt + max_new_tokens", config)


def _check_state_dict(own, state_dict):
    """Check that state_dict fits a model whose own state dict is own, but for Orthros's
    scale-offsets; return the names of those it lacks."""
    wrong = [k for k, w in state_dict.items() if k in own and own[k].shape != w.shape]
    if wrong:
        raise ValueError(f"state dict does not fit this model: {wrong[0]} has shape "
                         f"{tuple(state_dict[wrong[0]].shape)}, this model's is "
                         f"{tuple(own[wrong[0]].shape)}. "
                         "Is it from a model of another size?")
    missing = [k for k in own if k not in state_dict]
    bad_missing = [k for k in missing if identity_scale_offset(k) is None]
    # An Orthros's scale-offsets may be left out only where they are the identity (converted).
    def identity(k, w):
        return identity_scale_offset(k) is not None and bool((w == identity_scale_offset(k)).all())
    unexpected = [k for k, w in state_dict.items() if k not in own and not identity(k, w)]
    if bad_missing or unexpected:
        raise ValueError(f"state dict does not fit this model: missing {bad_missing}, "
                         f"unexpected {unexpected}. Is it from a model of another size?")
    return missing


def repeat_kv(x, n_head):
    """Grouped-query attention: K or V (B, n_kv_head, S, D) -> (B, n_head, S, D). Query head h
    reads K, V head h // (n_head / n_kv_head), as in Llama; without groups, x itself."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def llama3_inv_freq(inv_freq, scaling):
    """Llama 3's RoPE scaling (rope_type "llama3", Meta's formula): channels of wavelength above
    original_max_position_embeddings / low_freq_factor turn factor times slower, those below .../
    high_freq_factor keep their speed, and those between blend, linearly in original_max_... /
    wavelength."""
    factor, low, high, old_len = (scaling[k] for k in LLAMA3_ROPE_KEYS)
    smooth = ((old_len / (2 * math.pi / inv_freq) - low) / (high - low)).clamp(0, 1)  # 0: slowed
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class ShortConv(nn.Module):
    """Not in the paper: a short causal depthwise convolution that mixes each base token with
    the K-1 before it, before K and V are projected; the same for all three attn types. Off
    (conv_kernel = 0) by default and in every paper configuration. It starts as the identity.
    When decoding it keeps its last K-1 inputs in the layer's cache (cache.conv_state)."""

    def __init__(self, C, kernel_size):
        super().__init__()
        weight = torch.zeros(C, 1, kernel_size)
        weight[:, 0, -1] = 1.0   # each token passes itself
        self.weight = nn.Parameter(weight)

    def forward(self, x, cache=None):
        """x: (B, T, C) -> (B, T, C), continuing from cache.conv_state when there is one."""
        state = cache.conv_state if cache is not None else None
        if state is None:
            state = x.new_zeros(x.size(0), self.weight.size(-1) - 1, x.size(-1))
        y, state = causal_depthwise_conv(x, self.weight, state)
        if cache is not None:
            cache.conv_state = state
        return y


def causal_depthwise_conv(x, weight, state):
    """x: (B, T, C), weight: (C, 1, K), state: (B, K-1, C), the K-1 inputs before x (zeros at
    the start). Returns the output (B, T, C) and the new state, the last K-1 inputs."""
    x = torch.cat([state, x], dim=1)
    y = F.conv1d(x.transpose(1, 2), weight, groups=x.size(-1)).transpose(1, 2)
    return y, x[:, x.size(1) - state.size(1):]


# =============================================================================
# 3. Fast paths: the same numbers as part 1, faster. Skip on a first reading.
# =============================================================================

def fast_reference_attention(q, k, v, window=None, swa_impl="auto", dropout_p=0.0):
    """reference_attention(q, k, v, window, dropout_p) of part 1, by the cheapest exact kernel.

    q: (B, H, Tq, D), k, v: (B, H, Tk, D); the queries are the last Tq of the Tk key positions: base
    tokens (Tq = Tk; fewer when continuing a cache, 1 in decoding) and output tokens.
    """
    Tq, Tk = q.size(-2), k.size(-2)
    if Tq == 0:    # the baselines' (empty) output stream
        return q
    if window is not None and Tq < Tk:   # keys older than the first query's window are never read
        Tk = min(Tk, Tq + window - 1)    # (copies: a strided view would recompile FlexAttention)
        k, v = k[:, :, -Tk:].contiguous(), v[:, :, -Tk:].contiguous()
    if window is None or window >= Tk:   # no key falls out of the window: causal attention
        if Tq == Tk:  # square: is_causal is right, and lets SDPA use its fastest kernels
            return sdpa(q, k, v, is_causal=True, dropout_p=dropout_p)
        mask = None if Tq == 1 else attention_mask(Tq, Tk, None, q.device)  # (one query sees all)
        # NOTE: q is a slice of both streams' queries, a strided view; a contiguous copy (small)
        # keeps SDPA on its fused kernels instead of a slow fallback.
        return sdpa(q.contiguous(), k, v, mask, dropout_p=dropout_p)
    pad = Tk - Tq  # a chunk continuing a cache: dummy queries in front square it (rows dropped)
    q = F.pad(q, (0, 0, pad, 0))
    # FlexAttention for "flex" (and "auto" on CUDA); it has no attention dropout, so training
    # with dropout takes the blocked path.
    if (swa_impl == "flex" or (swa_impl == "auto" and q.is_cuda)) and dropout_p == 0.0:
        return flex_sliding_window_attention(q, k, v, window)[:, :, pad:]
    return blocked_sliding_window_attention(q, k, v, window, dropout_p)[:, :, pad:]


def sdpa(q, k, v, mask=None, is_causal=False, dropout_p=0.0):
    """F.scaled_dot_product_attention, kept off the cuDNN backend but for plain causal inference.

    NOTE: on Hopper GPUs, torch 2.11 sends bf16 SDPA to cuDNN by default. cuDNN builds a new
    plan for every new shape (tens of ms per decode step, where the cache grows by one key each
    time), and it has traps: with explicit masks fully masked rows are not zero, and gradients
    can be NaN for some key lengths (S % 128 == 64). Training never runs it (a NaN that came and
    went in the CUDA tests' SFT run); the flash and memory-efficient kernels have none of these.
    """
    if q.is_cuda and (not is_causal or torch.is_grad_enabled()):
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)


def blocked_sliding_window_attention(q, k, v, window, dropout_p=0.0):
    """Eq. 4 in O(T w): the same result as the reference without the (T, T) mask.

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

    def table(start, stop):  # consecutive block indices: counts (1, 1, n), indices (1, 1, n, width)
        indices = (start[:, None] + torch.arange(width, device=device)).clamp(max=n - 1)
        return (stop - start + 1).int()[None, None], indices.int()[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return in_window(q_idx, kv_idx, window)  # looked up at each call: a patch applies

    kv_num_blocks, kv_indices = table(first, blocks)
    if torch.device(device).type == "cpu":
        # NOTE: torch 2.13's Inductor CPU lowering of flex_attention asserts that the table is
        # ceil(T/128) columns wide, though its kernel, like the CUDA kernels, reads only the first
        # kv_num_blocks entries of each row. Hand it an (n, n) view of the narrow rows' storage
        # (plus n spare entries) rather than an O(n^2) copy; the columns past a row's count are
        # never read. BlockMask.to_dense() assumes a full-width table: don't use it on these masks.
        storage = torch.cat([kv_indices.flatten(), kv_indices.new_zeros(n)])
        kv_indices = storage.as_strided((1, 1, n, n), (n * width, n * width, width, 1))
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(T, T), compute_q_blocks=False)
    if compute_q_blocks:
        # torch's own transpose (compute_q_blocks=True) needs a full-width table: build ours.
        mask.q_num_blocks, mask.q_indices = table(blocks, last)
    return mask


@functools.lru_cache(maxsize=8)
def cached_sliding_window_block_mask(T, window, device, grad_enabled):
    """sliding_window_block_mask, built once per (T, window, device, grad mode) and reused by
    every layer and every call with that shape."""
    return sliding_window_block_mask(T, window, device, compute_q_blocks=grad_enabled)


compile_once = functools.cache(torch.compile)  # compile_once(f): torch.compile(f), made once


def flex_sliding_window_attention(q, k, v, window):
    """Eq. 4 with FlexAttention: a fused kernel that skips the key blocks outside the window.
    FlexAttention is fast only when compiled: outside torch.compile we call a compiled copy; inside
    (compile_blocks) the block mask's few index ops fuse into the graph."""
    from torch.nn.attention.flex_attention import flex_attention
    T = q.size(-2)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=sliding_window_block_mask(T, window, q.device))
    block_mask = cached_sliding_window_block_mask(T, window, q.device, torch.is_grad_enabled())
    return compile_once(flex_attention)(q, k, v, block_mask=block_mask)


def activation_dtype(weight):
    """The dtype the activations run in: autocast's (e.g. bf16) when it is on, else the weights'.
    The RoPE tables are made in it, so that rotated queries and keys keep the kernels' dtype."""
    device_type = weight.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # (no autocast on "meta")
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def compile_blocks(model, **kwargs):
    """torch.compile every block of model, its hot loop, in place: it fuses RoPE, the
    scale-offsets, norms and residual adds into a few kernels. prefill, decode and generate
    stay plain Python around the compiled blocks. Returns the model."""
    for block in model.blocks:
        block.compile(**kwargs)
    return model
