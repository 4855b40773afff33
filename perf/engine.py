"""
A fast decoder for Orthros and its baselines: the naive decoder's numbers (orthros.py's prefill and decode), faster.
The naive decoder grows its cache by concatenation and runs a few hundred small kernels per token from Python.
FastDecoder keeps per layer a static cache, K and V (B, H_kv, rows, D), written in place at row pos, a device tensor,
so that a step's shapes never change; computes both twins' attention (query row 0 the base twin, over its window:
eq. 4; row 1 the output twin, over every key: eq. 5; the masks are orthros.in_window's); projects q, k and v in one
matmul; and chooses the next token (orthros.sample_next) on the device, as the next step's input.
On CUDA a step is one CUDA graph replay. Two ways to run the step:
  compile=False  eager ops captured in the CUDA graph, SDPA over every cache row with the mask: nothing to compile,
                 ready in a fraction of a second; each step reads all rows (sample.py's choice: rows = its length).
  compile=True   the step compiled as one graph with a FlexAttention call per twin, whose table of key blocks comes
                 from pos: a step reads only the blocks it attends (the bench's long contexts); compiling takes seconds.

    decoder = FastDecoder(model, batch_size=B, max_len=T + max_new_tokens, compile=True)
    for token in decoder.generate_tokens(idx, max_new_tokens, temperature=0): ...   # as model.generate_tokens
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import orthros
from orthros import apply_rope, causal_depthwise_conv, in_window, repeat_kv, rope_cos_sin

BLOCK = 128  # FlexAttention's block of keys: the unit of its block table, and of the cache's rows
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what FlexAttention computes in


def block_table(pos, window, n_blocks):
    """FlexAttention's table of the key blocks that the token at position pos (a (1,) tensor) attends: kv_num_blocks
    (1, 1, 1), kv_indices (1, 1, 1, n_blocks), int32: from key pos - window + 1's block (window None: 0) to key pos's."""
    first = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0) // BLOCK
    indices = (first + torch.arange(n_blocks, device=pos.device)).clamp(max=n_blocks - 1)
    return (pos // BLOCK - first + 1).int().view(1, 1, 1), indices.int().view(1, 1, 1, n_blocks)


def decode_block_mask(pos, window, rows):
    """FlexAttention's BlockMask of the new token at position pos (a (1,) tensor) over `rows` cache rows, and refresh(),
    which rewrites its block table in place for the current pos: the token may attend key kv_idx where in_window(pos,
    kv_idx, window) (window None: every key up to pos)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return in_window(pos[0], kv_idx, window)

    def refresh():
        for old, new in zip((mask.kv_num_blocks, mask.kv_indices), block_table(pos, window, rows // BLOCK)):
            old.copy_(new)

    table = block_table(pos, window, rows // BLOCK)
    # NOTE: torch 2.13's CPU kernel for one query row needs a table of "full" blocks: an empty one (a GPU's would not).
    full = [torch.zeros_like(t) for t in table] if pos.device.type == "cpu" else [None, None]
    mask = BlockMask.from_kv_blocks(*table, *full, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(1, rows), compute_q_blocks=False)
    return mask, refresh


def kernel_split(model, batch_size, rows, device):
    """FlexAttention's options for a cache of `rows` keys: split the keys over the SMs (FlexAttention's default is 2
    pieces per SM; twice that was faster at 128K), but never into pieces of less than one block of keys (empty
    pieces still cost a launch slot and a row in the reduction); 3 stages of 32 keys (results/README.md, Decode)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split = 4 * max(sms // (batch_size * model.blocks[0].attn.n_kv_head), 1)
    return {"SPLIT_KV": max(1, min(split, rows // BLOCK)), "BLOCK_N": 32, "num_stages": 3}


def layer_in(block, z, k_cache, v_cache, conv_state, pos, rope, weights):
    """Alg. 1, lines 2-7, for the new token: z (B, L, C), L = 2 twins for Orthros, 1 for the baselines
    -> the queries q (B, H, L, D); its K, V (and conv state) written at row pos of the layer's cache."""
    attn, (B, L, _) = block.attn, z.shape
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
    q, k = attn.head_norm(q, attn.q_norm), attn.head_norm(k, attn.k_norm)   # qk_norm only
    if alpha is not None:                                # Alg. 1, line 5: each twin's alpha * q + beta
        q = torch.addcmul(beta, alpha, q)
    cos, sin = rope                                      # Alg. 1, lines 6-7: both twins sit at pos
    q = apply_rope(q.view(B, L, H, D).transpose(1, 2), cos, sin)            # (B, H, L, D)
    k_cache.index_copy_(2, pos, apply_rope(k.view(B, 1, H_kv, D).transpose(1, 2), cos, sin))
    v_cache.index_copy_(2, pos, v.view(B, 1, H_kv, D).transpose(1, 2))     # (B, H_kv, 1, D): the new token
    return q


def layer_out(block, z, y):
    """Alg. 1, lines 10-12, and Alg. 2, lines 5-7: z (B, L, C) and the attention's output y (B, H, L, D)."""
    z = z + block.attn.c_proj(y.transpose(1, 2).flatten(2))   # (B, L, H * D)
    return z + block.mlp(block.ln_2(z))


def stacked_weights(attn):
    """layer_in()'s weights, copies: (W_Q, W_K, W_V stacked, their biases, alpha (2, C), beta (2, C)), None where none."""
    linears = (attn.c_q, attn.c_k, attn.c_v)
    w_qkv = None if attn.conv is not None else torch.cat([m.weight for m in linears])
    b_qkv = None if w_qkv is None or attn.c_q.bias is None else torch.cat([m.bias for m in linears])
    stack = lambda *names: torch.stack([getattr(attn, name) for name in names]) if attn.scale_offset else None
    return w_qkv, b_qkv, stack("alpha", "alpha_out"), stack("beta", "beta_out")


class StaticKVCache:
    """The cache of B sequences, rows = max_len rounded up to whole blocks: per layer l, k[l], v[l] (B, H_kv, rows, D),
    keys after RoPE and values, conv[l] (B, K-1, C) or None. Rows >= length: masked, finite (they meet a weight of 0)."""

    def __init__(self, model, batch_size, max_len, zeros):
        attn, self.rows, conv = model.blocks[0].attn, -(-max_len // BLOCK) * BLOCK, model.config.conv_kernel
        self.k, self.v = ([zeros(batch_size, attn.n_kv_head, self.rows, attn.head_dim) for _ in model.blocks] for _ in "kv")
        self.conv = [zeros(batch_size, conv - 1, model.config.n_embd) if conv else None for _ in model.blocks]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0


class FastDecoder:
    """prefill, decode and generate_tokens like the model's, over a StaticKVCache. model: an Orthros in eval mode, on
    its device, in float32, float16 or bfloat16. batch_size, max_len: the cache's size (max_len <= max_seq_len).
    compile: True (or torch.compile's options) compiles the step as one graph per sampling rule, with FlexAttention;
    False: eager, SDPA. cuda_graphs: default on CUDA. kernel_options: FlexAttention's. NOTE: prefill() copies W_Q, W_K,
    W_V and the scale-offsets (stacked), the other weights are read where they are: change weights between generations."""

    def __init__(self, model, batch_size, max_len=None, compile=False, cuda_graphs=None, kernel_options=None):
        cfg, max_len = model.config, model.config.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len or batch_size < 1:
            raise ValueError(f"max_len must be in 1..max_seq_len={cfg.max_seq_len} and batch_size >= 1, got {max_len} and "
                             f"{batch_size}; build the model with a larger max_seq_len to decode further")
        device, dtype = model.wte.weight.device, model.wte.weight.dtype
        if dtype not in DTYPES:
            raise ValueError(f"FastDecoder runs FlexAttention, which computes in {', '.join(map(str, DTYPES))}; "
                             f"the model is in {dtype}: convert it (model.float()) or decode with the model's own decode()")
        self.model, self.orthros, self.compiled = model, cfg.attn == "orthros", bool(compile)
        self.windows = (model.blocks[0].attn.window,) + ((None,) if self.orthros else ())  # per query row (None: all)
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: writable in and out of inference mode
            self.cache = StaticKVCache(model, batch_size, max_len, lambda *s: torch.zeros(*s, device=device, dtype=dtype))
            self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the step's input, then its output
            self.pos = torch.zeros(1, dtype=torch.long, device=device)                # ... and its position
            self.rows = torch.arange(self.cache.rows, device=device)                  # every key's position
            # One FlexAttention call per twin (row), each with its mask: Orthros's base twin reads only the blocks of its
            # window. (Both twins as two query rows of one call put Orthros's logits 2.5x further from float32 than
            # the naive decoder's, inside the compiled step on an H100; one row per call was as close as naive.)
            self.flex = []   # compiled: per twin, its block mask, the mask's refresh() and FlexAttention's options
            for w in self.windows if compile else ():
                options = kernel_options
                if device.type == "cuda":  # FlexAttention's KV split, 3 stages of 32 keys (results/README.md, Decode)
                    reads = self.cache.rows if w is None else min(self.cache.rows, w + BLOCK)
                    options = {**kernel_split(model, batch_size, reads, device), **(kernel_options or {})}
                self.flex.append((*decode_block_mask(self.pos, w, self.cache.rows), options))
            self.weights = [stacked_weights(block.attn) for block in model.blocks]
        # The step is the unbound function, called with self: a bound method kept on self would hold it in a
        # reference cycle, and with it the cache, after the caller lets go of the decoder.
        self.step = FastDecoder._step
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # past it: eager
            # Inductor's layout optimization off: a graph with a convolution (conv_kernel > 0) had its tensors laid out
            # channels-last, which put Orthros's logits 3.5x further from float32 than the naive decoder's (an H100's
            # and a CPU's). Prologue fusion (the queries' RoPE inside FlexAttention's kernel) off: as measured.
            off = {"layout_optimization": False, "prologue_fusion": False}
            options = compile if isinstance(compile, dict) else {"options": off}
            self.step = torch.compile(FastDecoder._step, fullgraph=True, dynamic=False, **options)
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = {}  # per sampling rule (temperature, top_k): the CUDA graph and its logits

    @torch.no_grad()
    def prefill(self, idx, naive=None):
        """The prompt idx (B, T) by the model's own prefill (naive: its KVCache, if prefilled already), copied into the
        static cache with the weights: (logits (B, 1, vocab) or None, cache)."""
        cache, logits = self.cache, None
        if idx.dim() != 2 or idx.size(0) != cache.batch_size or idx.size(1) > cache.max_len:
            raise ValueError(f"prefill got idx of shape {tuple(idx.shape)}; this decoder was built for batch_size="
                             f"{cache.batch_size}: pass (batch_size, T) token ids, T <= max_len={cache.max_len}")
        if naive is None:
            logits, naive = self.model.prefill(idx)
        if not isinstance(naive, orthros.KVCache) or naive.model() is not self.model or naive.length != idx.size(1):
            raise ValueError("prefill's naive= takes the KVCache of idx made by this decoder's model (model.prefill)")
        for l, block in enumerate(self.model.blocks):   # in place: a captured CUDA graph reads these tensors
            cache.k[l][:, :, :idx.size(1)].copy_(naive.layers[l].k)
            cache.v[l][:, :, :idx.size(1)].copy_(naive.layers[l].v)
            for mine, theirs in zip((cache.conv[l], *self.weights[l]), (naive.layers[l].conv_state, *stacked_weights(block.attn))):
                if mine is not None:
                    mine.copy_(theirs)
        cache.length = idx.size(1)
        return logits, cache

    @torch.no_grad()
    def decode(self, next_idx, cache):
        """Append one token per sequence, next_idx (B,) or (B, 1), at cache.length: (logits (B, 1, vocab), cache)."""
        self._advance(cache, next_idx)
        self.token.copy_(next_idx.reshape(-1, 1))
        self.pos.fill_(cache.length - 1)
        return self._run(0, None).clone(), cache   # a copy: the graph overwrites its output at the next replay

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, prompt=None):
        """model.generate_tokens's loop (its tokens at temperature 0); after the first token, each is one run of the
        step, which draws it. prompt: (logits, KVCache) of idx, if prefilled already."""
        orthros._check_generation(self.model.config, idx, max_new_tokens, temperature, top_k)
        logits, cache = self.prefill(idx) if prompt is None else (prompt[0], self.prefill(idx, prompt[1])[1])
        self.token.copy_(orthros.sample_next(logits, temperature, top_k))   # the first token: after the prefill
        self.pos.fill_(cache.length)
        for step in range(max_new_tokens):
            yield self.token.clone()
            if step < max_new_tokens - 1:
                self._advance(cache)
                self._run(temperature, top_k)   # the next token into self.token; self.pos moves on

    @torch.no_grad()
    def warm_up(self, temperature=1.0, top_k=None):
        """Compile the step for this sampling rule and capture its CUDA graph now, not at its first use (sample.py
        times this apart). The cache and the random generator are left as they were."""
        with torch.random.fork_rng([self.pos.device] if self.pos.is_cuda else []), self._kept():
            self._run(temperature, top_k)

    def _advance(self, cache, next_idx=None):
        if cache is not self.cache or cache.length == 0:
            raise ValueError("decode needs this decoder's cache, filled by its prefill(): call decoder.prefill(prompt) first")
        if next_idx is not None and next_idx.numel() != cache.batch_size:
            raise ValueError(f"decode got {next_idx.numel()} tokens for batch size {cache.batch_size}: pass one per sequence")
        if cache.length >= cache.max_len:
            raise ValueError(f"cannot decode past max_len={cache.max_len}: build the FastDecoder with a larger max_len")
        cache.length += 1

    @contextlib.contextmanager
    def _kept(self):
        """Undo the steps' moves of the token, the position and the conv state (K, V at row pos: rewritten before read)."""
        saved = [(t, t.clone()) for t in (self.token, self.pos, *self.cache.conv) if t is not None]
        yield
        for t, s in saved:
            t.copy_(s)

    def _run(self, temperature, top_k):
        """One step: a replay of the rule's CUDA graph (captured at first use, after a step aside to compile and set cuBLAS
        up), or a call. Its logits, which the next step overwrites."""
        if not self.cuda_graphs:
            return self.step_and_advance(temperature, top_k)
        if (temperature, top_k) not in self.graphs:
            # The step aside and the capture leave the random generator as it was: a seed gives the same tokens
            # whether or not this rule's graph existed before.
            with torch.random.fork_rng([self.pos.device]):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), self._kept():
                    self.step_and_advance(temperature, top_k)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = self.step_and_advance(temperature, top_k)
            self.graphs[temperature, top_k] = graph, logits
        graph, logits = self.graphs[temperature, top_k]
        graph.replay()
        return logits

    def step_and_advance(self, temperature, top_k):
        """The step, then pos + 1. NOTE: pos moves outside the compiled step. Mutated inside it, after the FlexAttention
        calls whose mask_mod reads it, it put Orthros's logits 2.5x further from float32 than the naive decoder's on an
        H100 (the same graph with SDPA and a mask made before the mutation was as close as naive): Inductor does not
        count mask_mod's read of pos as a use, and may move the increment before the last layers' attention."""
        logits = self.step(self, temperature, top_k)
        self.pos.add_(1)
        return logits

    def _step(self, temperature, top_k):
        """One step for self.token at self.pos: the logits (B, 1, vocab); the next token replaces self.token."""
        model, cfg, c = self.model, self.model.config, self.cache
        x = model.wte(self.token)                                       # (B, 1, C)
        z = torch.cat([x, x], dim=1) if self.orthros else x             # Alg. 2, line 2: the two twins
        rope = rope_cos_sin(self.pos, model.blocks[0].attn.head_dim, cfg.rope_base, x.dtype, cfg.rope_scaling)
        if self.compiled:
            for _, refresh, _ in self.flex:                             # the key blocks up to pos
                refresh()
        else:                                                           # query row r may attend key j: (L, rows)
            allowed = torch.stack([in_window(self.pos, self.rows, window) for window in self.windows])
        for l, block in enumerate(model.blocks):                        # Alg. 2, lines 3-7
            q = layer_in(block, z, c.k[l], c.v[l], c.conv[l], self.pos, rope, self.weights[l])
            if self.compiled:   # Alg. 1, lines 8-9, a FlexAttention call per twin: (B, H, L, D)
                # NOTE: each twin's query a copy: compiled on a CPU, torch 2.13's FlexAttention read the output
                # twin's query row, sliced out of q, at the base twin's (found on a CPU; harmless on a GPU).
                y = torch.cat([flex_attention(q[:, :, r:r + 1].contiguous(), c.k[l], c.v[l], block_mask=mask,
                                              kernel_options=options, enable_gqa=q.size(1) != c.k[l].size(1))
                               for r, (mask, _, options) in enumerate(self.flex)], dim=2)
            else:               # the same by SDPA, over every row of the cache
                y = orthros.sdpa(q, repeat_kv(c.k[l], q.size(1)), repeat_kv(c.v[l], q.size(1)), allowed)
            z = layer_out(block, z, y)
        logits = model.lm_head(model.ln_f(z[:, -1:]))                   # Alg. 2, lines 9-10
        self.token.copy_(orthros.sample_next(logits, temperature, top_k))
        return logits
