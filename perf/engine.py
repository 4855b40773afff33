"""
A fast decoder for Orthros and its baselines: the naive decoder's numbers (Orthros.prefill and
Orthros.decode in orthros.py), faster. The naive decoder grows its cache by concatenation (each
step copies it) and runs a few hundred small kernels per token from Python. FastDecoder instead
  - keeps per layer a static cache, K and V (B, H_kv, rows, D), written in place at row pos, a
    device tensor: a step's shapes never change, and one CUDA graph replays every step;
  - computes both twins' attention in one fused FlexAttention call per layer: the queries
    (B, H, 2, D) of the base twin (row 0, its window: eq. 4) and the output twin (row 1, every
    key: eq. 5) read each key once (the baselines: one row). The mask is orthros.in_window; the
    table of key blocks comes from pos: a step reads only the blocks up to the new token (SWA:
    those of its window);
  - projects q, k and v with one matmul (W_Q, W_K, W_V stacked; not with the convolution);
  - with compile=True, compiles the whole step as one graph: the embedding, every layer with its
    FlexAttention call, the head, and the choice of the next token (sample()), which it feeds
    back as the next step's input: generating a token is one graph replay, with no sync.

    decoder = FastDecoder(model, batch_size=B, max_len=T + max_new_tokens, compile=True)
    decoder.warm_up(temperature=0)                    # optional: compile and capture now, not at first use
    for token in decoder.generate_tokens(idx, max_new_tokens, temperature=0): ...   # as model.generate_tokens
    logits, cache = decoder.prefill(idx)              # or step by step: decoder.decode(next_idx, cache)
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import orthros
from orthros import apply_rope, causal_depthwise_conv, in_window, rope_cos_sin

BLOCK = 128  # FlexAttention's block of keys: the unit of its block table, and of the cache's rows
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what FlexAttention computes in
# FlexAttention is one fused kernel only when compiled: one graph per model kind, batch and cache
# size, for every length (a lambda of its own: orthros.py compiles flex_attention for prefill).
compiled_flex_attention = torch.compile(lambda *args, **kwargs: flex_attention(*args, **kwargs),
                                        fullgraph=True, dynamic=False)


def block_table(pos, window, n_blocks):
    """FlexAttention's table of the key blocks that the token at position pos (a (1,) tensor)
    attends: kv_num_blocks (1, 1, 1) and kv_indices (1, 1, 1, n_blocks), int32, the blocks from
    the one of key pos - window + 1 (window None: block 0) to the one of key pos (mask_mod trims)."""
    first = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0) // BLOCK
    indices = (first + torch.arange(n_blocks, device=pos.device)).clamp(max=n_blocks - 1)
    return (pos // BLOCK - first + 1).int().view(1, 1, 1), indices.int().view(1, 1, 1, n_blocks)


def decode_block_mask(pos, windows, rows):
    """FlexAttention's BlockMask of the new token at position pos (a (1,) tensor) over a cache of
    `rows` rows, and refresh(), which rewrites its block table in place for the current pos (a
    CUDA graph replays it). Query row r may attend key kv_idx where in_window(pos, kv_idx,
    windows[r]): Orthros (w, None), row 0 the base twin (eq. 4), row 1 the output twin (eq. 5);
    the Transformer (None,); SWA (w,)."""
    def mask_mod(b, h, q_idx, kv_idx):
        allowed = [in_window(pos[0], kv_idx, window) for window in windows]
        return allowed[0] if len(allowed) == 1 else torch.where(q_idx == 0, allowed[0], allowed[1])

    def refresh():
        for old, new in zip((mask.kv_num_blocks, mask.kv_indices), block_table(pos, reach, rows // BLOCK)):
            old.copy_(new)

    reach = None if None in windows else windows[0]   # how far back any row reads
    table = block_table(pos, reach, rows // BLOCK)
    # NOTE: torch 2.13's CPU kernel for one query row fails to compile without a table of "full"
    # blocks: give it an empty one (on a GPU that would spread the KV split over the whole cache).
    full = [torch.zeros_like(t) for t in table] if pos.device.type == "cpu" else [None, None]
    mask = BlockMask.from_kv_blocks(*table, *full, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(len(windows), rows), compute_q_blocks=False)
    return mask, refresh


def layer_in(block, z, k_cache, v_cache, conv_state, pos, rope, weights):
    """Alg. 1, lines 2-7, for the new token: z (B, L, C), L = 2 (base twin, output twin) for
    Orthros, 1 for the baselines -> the queries q (B, H, L, D); its K, V (and conv state) written
    into the layer's k_cache, v_cache (conv_state) at row pos (a (1,) tensor). rope: at pos;
    weights: stacked_weights'."""
    attn = block.attn
    B, L, _ = z.shape
    H, H_kv, D = attn.n_head, attn.n_kv_head, attn.head_dim   # H_kv < H: grouped-query attention
    w_qkv, b_qkv, alpha, beta = weights
    h = block.ln_1(z)
    if w_qkv is not None:   # Alg. 1, line 4: one matmul for every row (the output twin's k, v are dropped)
        q, k, v = F.linear(h, w_qkv, b_qkv).split([H * D, H_kv * D, H_kv * D], dim=-1)
        k, v = k[:, :1], v[:, :1]                        # K, V from the base twin only (line 3)
    else:                                                # the optional short convolution (orthros.py, part 2)
        x, new_state = causal_depthwise_conv(h[:, :1], attn.conv.weight, conv_state)
        conv_state.copy_(new_state)
        q, k, v = attn.c_q(h), attn.c_k(x), attn.c_v(x)
    if alpha is not None:                                # Alg. 1, line 5: each twin's alpha * q + beta
        q = torch.addcmul(beta, alpha, q)
    cos, sin = rope                                      # Alg. 1, lines 6-7: both twins sit at pos
    q = apply_rope(q.view(B, L, H, D).transpose(1, 2), cos, sin)            # (B, H, L, D)
    k_cache.index_copy_(2, pos, apply_rope(k.view(B, 1, H_kv, D).transpose(1, 2), cos, sin))
    v_cache.index_copy_(2, pos, v.view(B, 1, H_kv, D).transpose(1, 2))     # (B, H_kv, 1, D): the new token
    return q


def layer_out(block, z, y):
    """Alg. 1, lines 10-12, and Alg. 2, lines 5-7: z (B, L, C) and the attention's output y (B, H, L, D)."""
    z = z + block.attn.c_proj(y.transpose(1, 2).reshape(z.shape))
    return z + block.mlp(block.ln_2(z))


def stacked_weights(attn):
    """layer_in()'s weights of this attention, new tensors: (W_Q, W_K, W_V stacked, their biases
    stacked, alpha (2, C), beta (2, C)), each None where it has none (W_QKV: with the convolution)."""
    linears = (attn.c_q, attn.c_k, attn.c_v)
    w_qkv = None if attn.conv is not None else torch.cat([m.weight for m in linears])
    b_qkv = None if w_qkv is None or attn.c_q.bias is None else torch.cat([m.bias for m in linears])
    stack = lambda *names: torch.stack([getattr(attn, name) for name in names]) if attn.scale_offset else None
    return w_qkv, b_qkv, stack("alpha", "alpha_out"), stack("beta", "beta_out")


def sample(logits, temperature, top_k):
    """orthros.sample_next's choice, on the GPU without a sync, so that it fits in the step's graph:
    the argmax at temperature 0; else a draw from softmax(logits / temperature) (the top_k
    likeliest, if given) by the exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i
    is token i with probability p_i. logits (B, 1, vocab) -> (B, 1)."""
    logits = logits[:, -1].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = F.softmax(logits, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)


class StaticKVCache:
    """The fast decoder's cache of B sequences, in rows = max_len rounded up to whole blocks: per
    layer l, k[l], v[l] (B, H_kv, rows, D), keys after RoPE and values, and conv[l] (B, K-1, C) or
    None. Rows >= length hold zeros or stale values: masked, and finite (they meet a weight of 0)."""

    def __init__(self, model, batch_size, max_len, zeros):
        attn, rows, conv = model.blocks[0].attn, -(-max_len // BLOCK) * BLOCK, model.config.conv_kernel
        self.k, self.v = ([zeros(batch_size, attn.n_kv_head, rows, attn.head_dim) for _ in model.blocks] for _ in "kv")
        self.conv = [zeros(batch_size, conv - 1, model.config.n_embd) if conv else None for _ in model.blocks]
        self.batch_size, self.max_len, self.rows, self.length = batch_size, max_len, rows, 0


class FastDecoder:
    """prefill/decode/generate_tokens like the model's own, over a StaticKVCache, a step one CUDA graph replay.

    model: an Orthros (any attn) in eval mode, on its device, in float32, float16 or bfloat16.
    batch_size, max_len: the cache's size (max_len <= model.config.max_seq_len; default: that).
    compile: True (or torch.compile options, e.g. {"backend": ...}) compiles the step, the choice of
    the next token included, as one graph (per sampling rule); False: eager but for FlexAttention.
    cuda_graphs: default on CUDA. kernel_options: FlexAttention's, over the decoder's own on CUDA.
    NOTE: W_Q, W_K, W_V and the scale-offsets are copied (stacked) at each prefill(), the other
    weights read where they are: change weights only between generations."""

    def __init__(self, model, batch_size, max_len=None, compile=False, cuda_graphs=None, kernel_options=None):
        cfg = model.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len or batch_size < 1:
            raise ValueError(f"max_len must be in 1..max_seq_len={cfg.max_seq_len} and batch_size >= 1, got {max_len} and "
                             f"{batch_size}; build the model with a larger max_seq_len to decode further")
        device, dtype = model.wte.weight.device, model.wte.weight.dtype
        if dtype not in DTYPES:
            raise ValueError(f"FastDecoder runs FlexAttention, which computes in {', '.join(map(str, DTYPES))}; "
                             f"the model is in {dtype}: convert it (model.float()) or decode with the model's own decode()")
        if device.type == "cuda":  # twice FlexAttention's KV split, 3 stages of 32 keys (results/README.md, Decode)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            kernel_options = {"SPLIT_KV": 4 * max(sms // (batch_size * model.blocks[0].attn.n_kv_head), 1),
                              "BLOCK_N": 32, "num_stages": 3, **(kernel_options or {})}
        self.model, self.kernel_options, self.orthros = model, kernel_options, cfg.attn == "orthros"
        windows = (model.blocks[0].attn.window,) + ((None,) if self.orthros else ())   # per query row (None: all keys)
        with torch.inference_mode(False):  # normal tensors: writable in and out of inference mode
            self.cache = StaticKVCache(model, batch_size, max_len, lambda *s: torch.zeros(*s, device=device, dtype=dtype))
            self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the step's input, then its output
            self.pos = torch.zeros(1, dtype=torch.long, device=device)                # ... and its position
            self.block_mask, self.refresh_block_mask = decode_block_mask(self.pos, windows, self.cache.rows)
            with torch.no_grad():
                self.weights = [stacked_weights(block.attn) for block in model.blocks]
        # NOTE: more graphs than torch._dynamo's default recompile_limit (8), e.g. three model kinds
        # at three batch sizes, would make it run the function eagerly without a word.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        options = compile if isinstance(compile, dict) else {}
        self.attention = flex_attention if compile else compiled_flex_attention   # inside the graph, or its own
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False, **options) if compile else self._step
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = {}  # per sampling rule (temperature, top_k): the CUDA graph and its logits

    @torch.no_grad()
    def prefill(self, idx):
        """The prompt idx (B, T) by the model's own prefill, its cache load()ed: (logits (B, 1, vocab), cache)."""
        cache = self.cache
        if idx.dim() != 2 or idx.size(0) != cache.batch_size or idx.size(1) > cache.max_len:
            raise ValueError(f"prefill got idx of shape {tuple(idx.shape)}; this decoder was built for batch_size="
                             f"{cache.batch_size}: pass (batch_size, T) token ids, T <= max_len={cache.max_len}")
        logits, naive = self.model.prefill(idx)
        return logits, self.load(naive)

    @torch.no_grad()
    def load(self, naive):
        """Copy a KVCache of this model (model.prefill's; left as it was) and the weights in: the cache, ready to decode."""
        cache = self.cache
        if not isinstance(naive, orthros.KVCache) or naive.model() is not self.model:
            raise ValueError("load() takes a KVCache made by this decoder's model (model.prefill)")
        T = naive.length
        if naive.batch_size != cache.batch_size or T > cache.max_len:
            raise ValueError(f"a cache of batch size {naive.batch_size} and length {T} does not fit this "
                             f"decoder (batch_size={cache.batch_size}, max_len={cache.max_len})")
        for l, block in enumerate(self.model.blocks):
            cache.k[l][:, :, :T].copy_(naive.layers[l].k)
            cache.v[l][:, :, :T].copy_(naive.layers[l].v)
            if cache.conv[l] is not None:
                cache.conv[l].copy_(naive.layers[l].conv_state)
            for mine, theirs in zip(self.weights[l], stacked_weights(block.attn)):
                if mine is not None:  # in place: a captured CUDA graph reads these tensors
                    mine.copy_(theirs)
        cache.length = T
        return cache

    @torch.no_grad()
    def decode(self, next_idx, cache):
        """Append one token per sequence, next_idx: (B,) or (B, 1), at position cache.length.
        Returns the logits (B, 1, vocab) for the following token, and the cache."""
        self._check(cache, next_idx)
        self.token.copy_(next_idx.reshape(-1, 1))
        self.pos.fill_(cache.length)
        cache.length += 1
        return self._run(0, None).clone(), cache   # a copy: the graph overwrites its output at the next replay

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, prompt=None):
        """model.generate_tokens's loop (the same tokens at temperature 0), each step after the
        first one replay of the step's graph, which draws the next token itself. prompt: idx's
        (logits, KVCache) if the model has prefilled it already, else None (prefill here)."""
        orthros._check_generation(self.model.config, idx, max_new_tokens, temperature, top_k)
        logits, cache = self.prefill(idx) if prompt is None else (prompt[0], self.load(prompt[1]))
        self.token.copy_(orthros.sample_next(logits, temperature, top_k))   # the first token: after the prefill
        self.pos.fill_(cache.length)
        for step in range(max_new_tokens):
            yield self.token.clone()
            if step < max_new_tokens - 1:
                self._check(cache)
                cache.length += 1
                self._run(temperature, top_k)   # writes the next token into self.token, advances self.pos

    def warm_up(self, temperature=1.0, top_k=None):
        """Compile the step for this sampling rule and capture its CUDA graph now, not at the first
        token (sample.py times this apart). The cache and the random generator are left as they were."""
        with torch.no_grad(), torch.random.fork_rng([self.pos.device] if self.pos.is_cuda else []):
            saved = [(t, t.clone()) for t in (self.token, self.pos, *filter(None, self.cache.conv))]
            self._run(temperature, top_k)
            for t, s in saved:
                t.copy_(s)

    def _check(self, cache, next_idx=None):
        if cache is not self.cache:
            raise ValueError("this cache was not made by this decoder's prefill(); call decoder.prefill(prompt) first")
        if cache.length == 0:
            raise ValueError("the cache is empty: call decoder.prefill(prompt) before decode()")
        if next_idx is not None and next_idx.numel() != cache.batch_size:
            raise ValueError(f"decode got {next_idx.numel()} tokens for batch size {cache.batch_size}: pass one per sequence")
        if cache.length >= cache.max_len:
            raise ValueError(f"cannot decode past max_len={cache.max_len}: build the FastDecoder with a larger max_len")

    def _run(self, temperature, top_k):
        """One step (a replay of its CUDA graph, captured at the rule's first use): its logits."""
        if not self.cuda_graphs:
            return self.step(temperature, top_k)
        if (temperature, top_k) not in self.graphs:
            self.graphs[temperature, top_k] = self._capture(temperature, top_k)
        graph, logits = self.graphs[temperature, top_k]
        graph.replay()
        return logits

    def _step(self, temperature, top_k):
        """One step for self.token at self.pos, tensor operations on fixed shapes: the logits (B, 1,
        vocab); the next token, drawn by sample(), replaces self.token and self.pos moves on."""
        model, cfg, c = self.model, self.model.config, self.cache
        x = model.wte(self.token)                                       # (B, 1, C)
        z = torch.cat([x, x], dim=1) if self.orthros else x             # Alg. 2, line 2: the two twins
        rope = rope_cos_sin(self.pos, model.blocks[0].attn.head_dim, cfg.rope_base, x.dtype, cfg.rope_scaling)
        self.refresh_block_mask()                                       # the key blocks up to pos
        for l, block in enumerate(model.blocks):                        # Alg. 2, lines 3-7
            q = layer_in(block, z, c.k[l], c.v[l], c.conv[l], self.pos, rope, self.weights[l])
            y = self.attention(q, c.k[l], c.v[l], block_mask=self.block_mask, kernel_options=self.kernel_options,
                               enable_gqa=q.size(1) != c.k[l].size(1))   # Alg. 1, lines 8-9: (B, H, L, D)
            z = layer_out(block, z, y)
        logits = model.lm_head(model.ln_f(z[:, -1:]))                   # Alg. 2, lines 9-10
        self.token.copy_(sample(logits, temperature, top_k))
        self.pos.add_(1)
        return logits

    def _capture(self, temperature, top_k):
        """The CUDA graph of _step() for this rule, and its output, after two steps to warm up."""
        saved = [(t, t.clone()) for t in (self.token, self.pos, *filter(None, self.cache.conv))]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: compilation, cuBLAS set-up
            for _ in range(2):
                self.step(temperature, top_k)
                for t, s in saved:   # NOTE: a step moves the token, position and conv state on: undo it
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step(temperature, top_k)
        return graph, logits
