"""
A fast decoder for Orthros and its baselines: the same math as the naive KVCache decoder in
orthros.py (Orthros.prefill / Orthros.decode), with a preallocated cache and a captured step.

The naive decoder grows its cache by concatenation (every step copies the whole cache) and
launches a few hundred small kernels per token from Python. FastDecoder instead:
  - keeps, per layer, K (B, H, rows, D) and V in chunks (rows / chunk, B, H, chunk, D) (and the
    conv state, if any), allocated once, rows = max_len rounded up to a whole bucket, and
    written in place: the new token's K, V go to row `pos`, a device tensor;
  - reads only the valid prefix of the cache, rounded up to a bucket (bucket_len, always a whole
    number of chunks), and masks the rows past it: within a bucket a step's shapes, and so its
    captured graph, stay fixed;
  - computes both twins' attention in one pass (decode_attention): the queries (B, H, 2, D) of
    the base and the output twin meet every key once (q @ K^T), row 0 (base twin) is masked to
    its window, row 1 (output twin) sees all keys; softmax in float32; then @ V chunk by chunk
    (one batched matmul over all chunks, the partial sums added up). From window_rows_from keys
    on, the base twin reads only its w keys, gathered by rows as SWA does, and the output twin
    alone reads the bucket: fewer kernels below, less memory traffic above;
  - from split_k_from keys on, splits the softmax over the chunks too (flash-decoding,
    split_k_attention): per-chunk maxima, sums and outputs, then one combine; so that a long
    context keeps the whole GPU busy even at batch 1 (a softmax kernel runs one row per block:
    B * H * 2 rows of 131,072 keys leave most of an H200 idle);
  - projects q, k and v with one matmul (W_Q, W_K, W_V stacked; not with the convolution);
  - on CUDA, replays the step as a CUDA graph per bucket. compile=True fuses the dense part of
    each layer (norms, RoPE, the MLP's activation, the residual adds) with torch.compile, at
    the decoder's fixed shapes; the attention over the cache stays as written here (cuBLAS
    matmuls), its shapes changing with the bucket. On CPU the same code runs eagerly; the
    tests compare it there.
results/README.md (Decode) compares this attention with one SDPA call per twin (3-16x slower on
an H200: SDPA's masked single-query kernel does not split the keys across the GPU).

    decoder = FastDecoder(model, batch_size=B, max_len=T + max_new_tokens)   # compile=True: faster
    logits, cache = decoder.prefill(idx)              # like model.prefill(idx)
    logits, cache = decoder.decode(next_idx, cache)   # like model.decode(next_idx, cache)
    model.generate_tokens(idx, max_new_tokens, decoder=decoder)   # the model's decode loop
"""

import torch
import torch.nn.functional as F

import orthros
from orthros import apply_rope, causal_depthwise_conv, rope_cos_sin

# The long-context paths, by default ("auto") where they paid on an H200 (results/README.md, Decode;
# bench model, bf16, Orthros with compiled layers): split-K at batch 1 from 64K keys (at 128K x 1:
# 393 against 338 tok/s; it cost 2% at 32K x 1 and 1% at 128K x 8), and the base twin's window by
# rows at batch >= 8 from 64K keys (128K x 8: 686 against 649; it cost 5% at 32K x 8 and 8% at
# 128K x 1, where a step is short and its extra kernels show).
SPLIT_K_FROM = 65536
WINDOW_ROWS_FROM = 65536


def long_context_paths(batch_size, split_k_from="auto", window_rows_from="auto"):
    """(split_k_from, window_rows_from) as FastDecoder uses them: "auto" resolved for the batch."""
    if split_k_from == "auto":
        split_k_from = SPLIT_K_FROM if batch_size == 1 else None
    if window_rows_from == "auto":
        window_rows_from = WINDOW_ROWS_FROM if batch_size >= 8 else None
    return split_k_from, window_rows_from


def bucket_granularity(n, chunk=256):
    """The step of the buckets around n keys: max(chunk, the power of two <= n / 64)."""
    return max(chunk, 1 << max((n - 1).bit_length() - 7, 0))


def bucket_len(n, chunk=256):
    """How many cache rows a step with n valid keys reads: n rounded up to a multiple of
    g = bucket_granularity(n, chunk), a multiple of chunk (a power of two). So a step reads at
    most max(chunk, n/64) rows too many (1.6%), and a context that doubles crosses at most 64
    buckets (graphs). Non-decreasing in n: bucket_len(max_len) rows hold every bucket."""
    g = bucket_granularity(n, chunk)
    return -(-n // g) * g


def key_masks(pos, n_keys, window):
    """Additive masks (0 = attend, -inf = not) over the first n_keys cache rows for the token
    at position pos (a (1,) tensor): (2, n_keys) float32, row 0 for the base twin (eq. 4, keys
    pos-w+1 .. pos; all keys <= pos without a window), row 1 for the output twin (eq. 5: keys
    0 .. pos). Both from orthros.in_window, the one definition of the window.
    NOTE: built from positions: SDPA's is_causal would align a single query with the first key,
    not the last."""
    k_pos = torch.arange(n_keys, device=pos.device)
    allowed = torch.stack([orthros.in_window(pos, k_pos, window), orthros.in_window(pos, k_pos, None)])
    return torch.where(allowed, 0.0, torch.full((), float("-inf"), device=pos.device))


def window_rows(pos, window):
    """The cache rows of the window of the token at position pos: (rows (w,), additive mask
    (1, w)). Rows before position 0 are clamped to row 0 and masked out; the mask is in_window's."""
    k_pos = pos - window + 1 + torch.arange(window, device=pos.device)
    allowed = orthros.in_window(pos, k_pos, window) & (k_pos >= 0)
    return k_pos.clamp(min=0), torch.where(allowed, 0.0, float("-inf"))[None]


def value_slots(rows, batch_heads, chunk):
    """Where cache rows `rows` (m,) of every sequence and head lie in a value cache of chunks
    (n, B, H, chunk, D) seen as (n * B * H * chunk, D) rows: (B * H, m) indices."""
    bh = torch.arange(batch_heads, device=rows.device)[:, None]
    return ((rows // chunk) * batch_heads + bh) * chunk + rows % chunk


def _wide_bmm(a, b):
    """a @ b for 3-D a, b, in at least float32: bf16/fp16 inputs give float32 output.
    NOTE: bf16 scores would be rounded to ~3 digits before the softmax (a score of 10 off by
    0.04 changes its weight by 4%); cuBLAS accumulates in float32 and can write float32."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.bmm(a, b)
    if not a.is_cuda:  # the CPU has no float32-output bmm; upcasting costs nothing that matters there
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b, out_dtype=torch.float32)


def _scores(q, k):
    """q @ k^T in at least float32: (B, H, L, D) x (B, H, S, D) (or (B * H, S, D)) -> (B, H, L, S):
    one matmul over all S keys (S is a whole bucket: cuBLAS is fast at such lengths, see FastDecoder)."""
    B, H, L, D = q.shape
    out = _wide_bmm(q.reshape(B * H, L, D), (k.flatten(0, 1) if k.dim() == 4 else k).transpose(1, 2))
    return out.view(B, H, L, -1)


def attend(q, k, v, mask):
    """Attention of queries q: (B, H, L, D) over k, v: (B, H, S, D) with the additive mask
    (L, S); softmax in float32. Returns (B, H, L, D). Every row keeps at least its own key."""
    scores = torch.add(mask, _scores(q, k), alpha=q.size(-1) ** -0.5)     # mask + QK^T / sqrt(D)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def chunked_values(p, v_chunks):
    """sum_c P_c @ V_c: p (B, H, L, S) float32 weights, v_chunks (n, B, H, c, D) the values of
    S = n * c keys in chunks. One batched matmul over the n * B * H chunks (the chunk-major
    cache makes them one stride apart: no copy of V), each (L, c) @ (c, D) in float32, then the
    n partial outputs added. Returns (B, H, L, D) in float32 (or p's dtype if wider)."""
    n, B, H, c, D = v_chunks.shape
    L = p.size(2)
    pt = torch.empty(n, B * H, L, c, dtype=v_chunks.dtype, device=p.device)   # chunk-major too:
    pt.copy_(p.reshape(B * H, L, n, c).permute(2, 0, 1, 3))                   # one transposing cast
    o = _wide_bmm(pt.view(n * B * H, L, c), v_chunks.reshape(n * B * H, c, D))  # (n * B * H, L, D)
    return o.view(n, B, H, L, D).sum(0)


def chunked_attention(q, k, v_chunks, mask):
    """attend() over the chunked value cache: q (B, H, L, D), k (B, H, S, D) or (B * H, S, D), v_chunks
    (n, B, H, c, D) with S = n * c, mask (L, S). Softmax in one kernel (one block per row).
    Returns float32 (or wider): the caller's cast to the model's dtype fuses with what follows."""
    scores = torch.add(mask, _scores(q, k), alpha=q.size(-1) ** -0.5)
    return chunked_values(torch.softmax(scores, dim=-1), v_chunks)


def split_k_attention(q, k, v_chunks, mask):
    """chunked_attention's result by split-K (flash-decoding): the S = n * c keys in n chunks
    of c, every step parallel over the B * H * L * n (row, chunk) pairs rather than the B * H * L
    rows alone. Same arguments and result. All in float32 (or wider):
      per chunk j: its maximum m_j, its sum l_j = sum_i exp(s_i - M) and its output
      o_j = sum_i exp(s_i - M) v_i, where M = max_j m_j is the row's maximum;
      combine: out = sum_j o_j / sum_j l_j.
    This is the log-sum-exp combine of flash-decoding, out = sum_j e^(m_j - M) o'_j /
    sum_j e^(m_j - M) l'_j with o'_j, l'_j relative to m_j, with the factor e^(m_j - M) folded
    into the exponent: the scores are in memory, so M is known before the exponentials (one
    rounding fewer, and no rescaling pass). A fully masked chunk (m_j = -inf) adds exactly 0."""
    n, c = v_chunks.size(0), v_chunks.size(3)
    s = torch.add(mask, _scores(q, k), alpha=q.size(-1) ** -0.5)          # (B, H, L, S)
    m = s.unflatten(-1, (n, c)).amax(-1)                                  # (B, H, L, n) chunk maxima
    p = s.sub_(m.amax(-1, keepdim=True)).exp_()                           # exp(s - M), in place
    l = p.unflatten(-1, (n, c)).sum(-1).sum(-1, keepdim=True)             # sum_j l_j: (B, H, L, 1)
    o = chunked_values(p, v_chunks)                                       # sum_j o_j: (B, H, L, D)
    return o / l


def decode_attention(q, k_cache, v_cache, masks, window, split):
    """Alg. 1, lines 8-9 for one new token: q (B, H, L, D), L = 2 for Orthros (row 0 the base
    twin, eq. 4; row 1 the output twin, eq. 5) or 1; k_cache (B, H, rows, D), v_cache
    (rows / c, B, H, c, D); masks (2, n, c): key_masks over the n * c rows of the bucket;
    window: (rows, value slots, mask) from window_rows and value_slots, or None;
    split: use split_k_attention (long contexts) rather than one softmax per row.
    Without window, both twins in one pass over the bucket: q @ K^T reads each key once for both
    rows, and row 0 is masked to its window (fewest kernels: short contexts). With window, the
    windowed row (SWA's only one, Orthros's base twin) reads just its w keys, gathered by rows,
    and Orthros's output twin alone reads the bucket: at long context that halves the scores
    written, softmaxed and read again (two rows of S floats against one), which a memory-bound
    step pays for in full."""
    B, H, L, D = q.shape
    if window is not None:   # the windowed row reads only its w keys
        rows, slots, mask = window
        k = k_cache.index_select(2, rows)
        v = v_cache.view(-1, D).index_select(0, slots).view(B, H, -1, D)
        y_window = attend(q[:, :, :1], k, v, mask)
        if L == 1:
            return y_window
    n, c = masks.size(1), masks.size(2)
    k, v_chunks = k_cache.flatten(0, 1)[:, :n * c], v_cache[:n]
    attention = split_k_attention if split else chunked_attention
    if window is None:
        return attention(q, k, v_chunks, masks[:L].flatten(1))
    return torch.cat([y_window, attention(q[:, :, 1:], k, v_chunks, masks[1:].flatten(1))], dim=2)


def layer_in(block, z, w_qkv, q_affine, rope, conv_state):
    """Alg. 1, lines 3-7 for the new token, the part of a layer before the cache: z (B, L, C),
    L = 2 (base twin, output twin) for Orthros, 1 for the baselines. Returns q (B, H, L, D) and
    the base twin's k (B, H, 1, D), both after RoPE, and v (B * H, D).
    w_qkv: W_Q, W_K and W_V stacked, (3C, C): q, k and v in one matmul, of every row (an output
    twin's k, v are dropped: one row more costs nothing in a matmul that reads the weights).
    None when the optional convolution is on: k, v then read the convolved base twin.
    q_affine: the scale-offsets stacked per twin, (alpha (2, C), beta (2, C)), or None.
    rope: (cos, sin) at the token's position; conv_state: (B, K-1, C) or None, updated in place."""
    attn = block.attn
    B, L, C = z.shape
    H, D = attn.n_head, attn.head_dim
    h = block.ln_1(z)
    if conv_state is None:
        q, k, v = F.linear(h, w_qkv).split(C, dim=-1)     # Alg. 1, lines 4-5: one W_Q for both twins,
        k, v = k[:, :1], v[:, :1]                         # K, V from the base twin (line 3) only
    else:                                                 # the optional short convolution
        x, new_state = causal_depthwise_conv(h[:, :1], attn.conv.weight, conv_state)
        conv_state.copy_(new_state)
        q, k, v = attn.c_q(h), attn.c_k(x), attn.c_v(x)
    if q_affine is not None:                              # Alg. 1, line 5: each twin's alpha * q + beta
        q = torch.addcmul(q_affine[1], q_affine[0], q)
    cos, sin = rope                                       # Alg. 1, lines 6-7; both twins sit at pos
    q = apply_rope(q.view(B, L, H, D).transpose(1, 2), cos, sin)            # (B, H, L, D)
    k = apply_rope(k.view(B, 1, H, D).transpose(1, 2), cos, sin)            # (B, H, 1, D)
    # contiguous: the attention's matmul needs q so; compiled, RoPE writes it that way (no copy)
    return q.contiguous(), k, v.reshape(B * H, D)


def layer_out(block, z, y):
    """Alg. 1, lines 10-12 and Alg. 2, lines 5-7, the part of a layer after the attention:
    z (B, L, C) the layer's input, y (B, H, L, D) the attention's output (any float dtype)."""
    B, L, C = z.shape
    z = z + block.attn.c_proj(y.to(z.dtype).transpose(1, 2).reshape(B, L, C))
    return z + block.mlp(block.ln_2(z))


class StaticKVCache:
    """The fast decoder's cache for B sequences, allocated once for max_len positions, in
    rows = bucket_len(max_len, chunk) rows: a whole number of chunks, and every bucket fits.
    Per layer l: k[l] (B, n_head, rows, head_dim), keys after RoPE; v[l] (rows / chunk, B,
    n_head, chunk, head_dim), values, chunk-major (see chunked_values); conv[l]
    (B, conv_kernel - 1, n_embd) or None. Rows >= length hold zeros or stale values: they are
    masked out (and must stay finite: they are multiplied by a weight of 0)."""

    def __init__(self, config, batch_size, max_len, device, dtype, chunk=256):
        H, D, n = config.n_head, config.n_embd // config.n_head, config.n_layer
        rows = bucket_len(max_len, chunk)
        zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)
        with torch.inference_mode(False):  # normal tensors: writable in and out of inference mode
            self.k = [zeros(batch_size, H, rows, D) for _ in range(n)]
            self.v = [zeros(rows // chunk, batch_size, H, chunk, D) for _ in range(n)]
            self.conv = [zeros(batch_size, config.conv_kernel - 1, config.n_embd) if config.conv_kernel else None
                         for _ in range(n)]
        self.batch_size, self.max_len, self.rows, self.chunk = batch_size, max_len, rows, chunk
        self.length = 0  # valid positions


class FastDecoder:
    """prefill/decode like the model's own, over a StaticKVCache, with a CUDA graph per bucket.

    model: an Orthros in eval mode, on its device and dtype. batch_size, max_len: the cache's
    size (max_len <= model.config.max_seq_len; default: that). cuda_graphs: capture the step
    (default: on CUDA). compile: torch.compile layer_in and layer_out (True, or a dict of
    torch.compile options, e.g. {"backend": ...}); their shapes are fixed for a decoder, so they
    compile once per model kind and batch size, never per step or bucket. chunk: a power of
    two, the cache's alignment and split-K's chunk (see bucket_len). split_k_from: split the softmax over chunks (split_k_attention) when a step
    reads at least this many keys; None: never. window_rows_from: from this many keys on,
    Orthros's base twin reads its window by rows, apart from the output twin (see
    decode_attention); None: never (SWA always does). "auto" (both): long_context_paths.
    After each decode, last_n_keys is the number of cache rows its attention read.
    NOTE: the step reads the weights where they are, but W_Q, W_K, W_V (stacked) and the
    scale-offsets (stacked per twin) are copied at each prefill(): change weights only between
    generations.
    """

    def __init__(self, model, batch_size, max_len=None, cuda_graphs=None, compile=False, chunk=256,
                 split_k_from="auto", window_rows_from="auto"):
        cfg = model.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in 1..max_seq_len={cfg.max_seq_len}, got {max_len}; "
                             "build the model with a larger max_seq_len to decode further")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {chunk}")
        split_k_from, window_rows_from = long_context_paths(batch_size, split_k_from, window_rows_from)
        for name, value in (("split_k_from", split_k_from), ("window_rows_from", window_rows_from)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None (never), got {value}")
        device, dtype = model.wte.weight.device, model.wte.weight.dtype
        self.model, self.chunk, self.split_k_from, self.window_rows_from = model, chunk, split_k_from, window_rows_from
        self.orthros = cfg.attn == "orthros"
        self.window = None if cfg.attn == "transformer" else cfg.window
        self.gather_window = cfg.attn == "swa"  # read the window by its rows (else: the masked bucket)
        # NOTE: the cache is bucket_len(max_len) rows long, not max_len, so that every step reads
        # a whole bucket, a multiple of chunk (256) keys. A step clamped to an odd count (say
        # max_len = 4,151) sends the matmuls over the keys down a slow cuBLAS path on an H200,
        # 2-13x slower than at a multiple of 256 (Orthros's (B*H, 2, D) x (D, n_keys) worst).
        self.cache = StaticKVCache(cfg, batch_size, max_len, device, dtype, chunk)
        self.layer_in, self.layer_out = layer_in, layer_out
        if compile:
            self._compile(compile if isinstance(compile, dict) else {})
        self.last_n_keys = None
        with torch.inference_mode(False):
            self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the step's input
            self.pos = torch.zeros(1, dtype=torch.long, device=device)                # ... and its position
            C = cfg.n_embd
            self.w_qkv = [None if cfg.conv_kernel else torch.empty(3 * C, C, device=device, dtype=dtype)
                          for _ in model.blocks]
            self.q_affine = [(torch.empty(2, C, device=device, dtype=dtype), torch.empty(2, C, device=device, dtype=dtype))
                             if block.attn.scale_offset else None for block in model.blocks]
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = {}  # n_keys -> (CUDAGraph, its static logits)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # shared by all buckets

    def _compile(self, options):
        """torch.compile layer_in and layer_out at static shapes (one graph per model kind and
        batch size, shared by all layers and decoders). The attention is left out: its shapes
        change with every bucket, and cuBLAS already reads the cache at the memory's speed.
        NOTE: graphs for several model kinds and batch sizes in one process are more than
        torch._dynamo's default recompile_limit (8), past which it would run the functions
        eagerly without a word; so raise it to >= 64."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.layer_in = torch.compile(layer_in, fullgraph=True, dynamic=False, **options)
        self.layer_out = torch.compile(layer_out, fullgraph=True, dynamic=False, **options)

    @torch.no_grad()
    def prefill(self, idx):
        """Run the prompt idx: (B, T) with the model's own prefill, then copy its keys, values
        and conv state into the static cache (load). Returns logits (B, 1, vocab) and the cache."""
        cache = self.cache
        if idx.dim() != 2 or idx.size(0) != cache.batch_size:
            raise ValueError(f"prefill got idx of shape {tuple(idx.shape)}; this decoder was built for "
                             f"batch_size={cache.batch_size}: pass (batch_size, T) token ids")
        if idx.size(1) > cache.max_len:
            raise ValueError(f"prompt of {idx.size(1)} tokens does not fit max_len={cache.max_len}")
        logits, naive = self.model.prefill(idx)
        return logits, self.load(naive)

    @torch.no_grad()
    def load(self, naive):
        """Copy a naive KVCache of this model (from model.prefill) into the static cache, and the
        stacked W_Q, W_K, W_V and the scale-offsets; the naive cache is left as it was. Returns the
        static cache, ready to decode."""
        cache = self.cache
        if not isinstance(naive, orthros.KVCache) or naive.model() is not self.model:
            raise ValueError("load() takes a KVCache made by this decoder's model (model.prefill)")
        T = naive.length
        if naive.batch_size != cache.batch_size or T > cache.max_len:
            raise ValueError(f"a cache of batch size {naive.batch_size} and length {T} does not fit this "
                             f"decoder (batch_size={cache.batch_size}, max_len={cache.max_len})")
        c = self.chunk
        for l, block in enumerate(self.model.blocks):
            layer = naive.layers[l]
            cache.k[l][:, :, :T].copy_(layer.k)
            full = T // c * c   # whole chunks, then the part of the last one
            cache.v[l][:T // c].copy_(layer.v[:, :, :full].unflatten(2, (T // c, c)).permute(2, 0, 1, 3, 4))
            if full < T:
                cache.v[l][T // c, :, :, :T - full].copy_(layer.v[:, :, full:])
            if cache.conv[l] is not None:
                cache.conv[l].copy_(layer.conv_state)
            attn = block.attn
            if self.w_qkv[l] is not None:
                self.w_qkv[l].copy_(torch.cat([attn.c_q.weight, attn.c_k.weight, attn.c_v.weight]))
            if self.q_affine[l] is not None:
                self.q_affine[l][0].copy_(torch.stack([attn.alpha, attn.alpha_out]))
                self.q_affine[l][1].copy_(torch.stack([attn.beta, attn.beta_out]))
        cache.length = T
        return cache

    def uses_split_k(self, n_keys):
        """Whether a step that reads n_keys cache rows splits its softmax over chunks."""
        return self.split_k_from is not None and n_keys >= self.split_k_from and not self.gather_window

    def uses_window_rows(self, n_keys):
        """Whether a step that reads n_keys cache rows gathers the windowed row's keys by rows."""
        return self.gather_window or (self.orthros and self.window_rows_from is not None
                                      and n_keys >= self.window_rows_from)

    @torch.no_grad()
    def decode(self, next_idx, cache):
        """Append one token per sequence, next_idx: (B,) or (B, 1), at position cache.length.
        Returns the logits (B, 1, vocab) for the following token, and the cache."""
        self._check(next_idx, cache)
        self.token.copy_(next_idx.reshape(-1, 1))
        self.pos.fill_(cache.length)
        n_keys = bucket_len(cache.length + 1, self.chunk)   # never clamped: the cache holds whole buckets
        assert n_keys <= cache.rows and n_keys % self.chunk == 0
        if self.cuda_graphs:
            graph, logits = self._graph(n_keys)
            graph.replay()
            logits = logits.clone()  # the graph overwrites its output at the next replay
        else:
            logits = self._step(n_keys)
        self.last_n_keys = n_keys
        cache.length += 1
        return logits, cache

    def _check(self, next_idx, cache):
        if cache is not self.cache:
            raise ValueError("this cache was not made by this decoder's prefill(); call decoder.prefill(prompt) first")
        if cache.length == 0:
            raise ValueError("the cache is empty: call decoder.prefill(prompt) before decode()")
        if next_idx.numel() != cache.batch_size:
            raise ValueError(f"decode got {next_idx.numel()} tokens for a cache of batch size {cache.batch_size}: "
                             "pass exactly one token per sequence")
        if cache.length >= cache.max_len:
            raise ValueError(f"cannot decode past max_len={cache.max_len}: build the FastDecoder with a larger max_len")

    def _step(self, n_keys):
        """One decode step for self.token at position self.pos, reading cache rows < n_keys.
        Only tensor operations on fixed shapes: a CUDA graph can replay it."""
        model, cfg, c = self.model, self.model.config, self.cache
        B, H = c.batch_size, cfg.n_head
        x = model.wte(self.token)                                       # (B, 1, C)
        z = torch.cat([x, x], dim=1) if self.orthros else x             # Alg. 2, line 2: the two twins
        rope = rope_cos_sin(self.pos, cfg.n_embd // cfg.n_head, cfg.rope_base, x.dtype)
        masks = key_masks(self.pos, n_keys, self.window).view(2, n_keys // self.chunk, self.chunk)
        slots = value_slots(self.pos, B * H, self.chunk).view(-1)       # the new token's value rows
        window = None
        if self.uses_window_rows(n_keys):
            rows, mask = window_rows(self.pos, cfg.window)
            window = (rows, value_slots(rows, B * H, self.chunk).view(-1), mask)
        split = self.uses_split_k(n_keys)
        for l, block in enumerate(model.blocks):   # Alg. 2, lines 4-7
            q, k, v = self.layer_in(block, z, self.w_qkv[l], self.q_affine[l], rope, c.conv[l])
            c.k[l].index_copy_(2, self.pos, k)                          # the base twin joins the cache
            c.v[l].view(-1, k.size(-1)).index_copy_(0, slots, v)
            y = decode_attention(q, c.k[l], c.v[l], masks, window, split)   # Alg. 1, lines 8-9
            z = self.layer_out(block, z, y)
        return model.lm_head(model.ln_f(z[:, -1:]))                     # Alg. 2, lines 9-10

    def _graph(self, n_keys):
        """The CUDA graph of _step(n_keys), captured at first use."""
        if n_keys not in self.graphs:
            convs = [c for c in self.cache.conv if c is not None]
            saved = [c.clone() for c in convs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph: compilation, cuBLAS set-up
                for _ in range(2):
                    self._step(n_keys)
                    # NOTE: a step shifts the conv state: undo it (the K, V it wrote at row pos
                    # are written again by the replay).
                    for c, s in zip(convs, saved):
                        c.copy_(s)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._step(n_keys)
            self.graphs[n_keys] = (graph, logits)
        return self.graphs[n_keys]
