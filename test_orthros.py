"""
What the tests prove of Orthros attention (paper section 3, Algorithms 1 and 2, eq. 4 and 5):

0. The model is the paper's: its logits and KV cache equal Algorithms 1 and 2 written out here.
1. Training equals prefill plus decode, and a cache continued by chunks of any length.
2. forward(t_out=k) is the last k rows of forward(t_out=T); the SFT loss and gradients agree.
3. The window is exact: query t sees key t-w+1, not t-w, on every path; fast paths = reference.
4. After L layers the KV cache at t depends on tokens t - L(w-1) ... t only; the output on all.
5. Causality: changing token j changes no logits before position j.
6. With w >= T and identity scale-offsets, Orthros from a Transformer's weights is that model.
1, 2 and 5 hold with every option of converted pretrained models as well. CPU, float64 where
exactness is the point; the tests marked `cuda` hold the GPU paths to the same references.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import orthros
from orthros import (ATTN_TYPES, SCALE_OFFSETS, Orthros, OrthrosConfig,
                     blocked_sliding_window_attention, compile_blocks, fast_reference_attention,
                     flex_sliding_window_attention, reference_attention, sliding_window_block_mask)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The options of converted pretrained models: grouped-query attention, SwiGLU, an untied head,
# RMSNorm's eps, Llama 3's RoPE scaling, Q/K/V biases, Qwen3's QK-norm and its own head width.
LLAMA = dict(n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=24, tie_embeddings=False,
             norm_eps=1e-5, qkv_bias=True, qk_norm=True, head_dim=6, rope_base=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
OPTIONS = {"plain": {}, "conv": dict(conv_kernel=3), "llama": LLAMA}


def make_model(attn="orthros", seed=0, dtype=torch.float64, randomize=True, **overrides):
    """A tiny model in float64, scale-offsets and convolution off identity (randomize)."""
    kw = dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=8, attn=attn, max_seq_len=512)
    torch.manual_seed(seed)
    model = Orthros(OrthrosConfig(**{**kw, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if randomize and (name.split(".")[-1] in SCALE_OFFSETS or ".conv." in name):
                p.add_(0.5 * torch.randn_like(p))
    return model


def tokens(B, T):
    return torch.randint(0, 37, (B, T))


def incremental_logits(model, idx, p, steps=None):
    """Logits at p-1 ... T-1 by prefill(idx[:, :p]), then a decode step per token (or `steps`)."""
    logits, cache = model.prefill(idx[:, :p])
    out = [logits]
    for t in range(p, idx.size(1) if steps is None else min(idx.size(1), p + steps)):
        logits, cache = model.decode(idx[:, t], cache)
        out.append(logits)
    return torch.cat(out, dim=1)


# -----------------------------------------------------------------------------
# Invariant 0: the model is the paper's. The reference below is written from the paper, one query
# at a time, sharing no code with orthros.py. Where the paper leaves a choice open, it makes
# orthros.py's documented ones: RMSNorm, a GELU MLP, RoPE, the LM head tied to the embedding.

def rope_as_complex(x, positions, base):
    """RoPE (Su et al. 2021): channels (i, i + D/2) of x (rows, H, D) are a complex number that
    turns by position * base^(-2i/D) (Llama's Hugging Face layout; Meta's pairs 2i, 2i+1)."""
    D = x.size(-1)
    pairs = torch.complex(x[..., :D // 2], x[..., D // 2:])                 # (rows, H, D/2)
    theta = base ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)   # (D/2,)
    turned = pairs * torch.exp(1j * positions.double()[:, None, None] * theta)  # e^(i t theta_i)
    return torch.cat([turned.real, turned.imag], dim=-1)


def paper_attention(X, T, attn, w, H, base):
    """Algorithm 1 for X: (T + T_out, d), T base then T_out output tokens; attn holds W_Q, W_K,
    W_V, W_O (x W = x @ weight.T) and alpha, beta, alpha', beta'. Returns Y, K, V."""
    T_out = len(X) - T
    W_Q, W_K, W_V, W_O = (linear.weight.T for linear in (attn.c_q, attn.c_k, attn.c_v, attn.c_proj))
    X, X_cross = X[:T], X[T:]                                                # line 3
    K, V = X @ W_K, X @ W_V                                                  # line 4
    Q = attn.alpha * (X @ W_Q) + attn.beta                                   # line 5
    Q_cross = attn.alpha_out * (X_cross @ W_Q) + attn.beta_out
    heads = lambda M: M.reshape(len(M), H, M.size(-1) // H)                  # 6-7: (rows, H, d_h)
    Q, K, V, Q_cross = heads(Q), heads(K), heads(V), heads(Q_cross)
    # RoPE, which Algorithm 1 leaves implicit: queries (after line 5) and keys turn by their
    # positions, an output token by its base twin's.
    pos = torch.arange(T)
    Q, K = rope_as_complex(Q, pos, base), rope_as_complex(K, pos, base)
    Q_cross = rope_as_complex(Q_cross, pos[T - T_out:], base)

    def o(q, t, first):  # eq. 4 and 5: q_t attends keys first ... t, softmax(q_t k_j / sqrt(d_h))
        scores = torch.einsum("hd,jhd->hj", q, K[first:t + 1]) / math.sqrt(q.size(-1))
        return torch.einsum("hj,jhd->hd", torch.softmax(scores, dim=-1), V[first:t + 1])

    O = [o(Q[t], t, max(0, t - w + 1)) for t in range(T)]                    # line 8: window w
    O_cross = [o(Q_cross[i], t, 0) for i, t in enumerate(range(T - T_out, T))]  # 9: every j <= t
    O = torch.stack(O + O_cross).flatten(1)                                  # 10-11: (T + T_out, d)
    return O @ W_O, K, V                                                     # line 12


def paper_model(model, idx, T_out):
    """Algorithm 2 for each sequence of idx (B, T), then the LM head: the logits (B, T_out, vocab)
    and, per layer, the base stream's K, V (B, H, T, d_h): what the KV cache must hold."""
    c = model.config
    eps = torch.finfo(model.wte.weight.dtype).eps
    rms_norm = lambda x, g: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g
    gelu = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    logits, kv = [], [[] for _ in model.blocks]
    for seq in idx:
        T, X = len(seq), model.wte.weight[seq]                               # (T, d)
        Z = torch.cat([X, X[T - T_out:]])                                    # line 2: T_out twins
        for layer, block in enumerate(model.blocks):                         # line 3
            A, K, V = paper_attention(rms_norm(Z, block.ln_1.weight), T, block.attn, c.window,
                                      c.n_head, c.rope_base)
            Z = Z + A                                                        # lines 4-5
            H = gelu(rms_norm(Z, block.ln_2.weight) @ block.mlp.c_fc.weight.T)
            Z = Z + H @ block.mlp.c_proj.weight.T                            # lines 6-7
            kv[layer].append((K.transpose(0, 1), V.transpose(0, 1)))
        Y = rms_norm(Z[T:], model.ln_f.weight)                               # 9-10: output tokens
        logits.append(Y @ model.lm_head.weight.T)
    return torch.stack(logits), [[torch.stack(t) for t in zip(*layer)] for layer in kv]


# NOTE: orthros.py makes its RoPE tables in float32 (as Llama's Hugging Face code does, which the
# conversion matches), so the float64 model agrees with this float64 reference to ~1e-6, not
# 1e-12. Every departure from the paper we tried moves the logits by more than 1e-2.
PAPER_TOL = dict(rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [3, 12, 20], ids=["w=3", "w=T-1", "w>T"])
def test_model_is_the_papers_algorithms(window):
    """Logits and KV cache equal Algorithms 1 and 2 written out, in every regime."""
    model = make_model(window=window)
    with torch.no_grad():
        for p in model.parameters():   # every weight off its start, each by its own draw
            p.add_(0.3 * torch.randn_like(p))
    attn = model.blocks[0].attn
    assert not torch.equal(attn.alpha, attn.alpha_out) and not torch.equal(attn.beta, attn.beta_out)
    idx = tokens(2, 13)
    with torch.no_grad():
        for t_out in (13, 5, 1):   # pre-training, SFT, prefill
            ours, paper = model(idx, t_out=t_out)[0], paper_model(model, idx, t_out)[0]
            torch.testing.assert_close(ours, paper, **PAPER_TOL)
        _, kv = paper_model(model, idx, 0)
        _, cache = model.prefill(idx)
        for layer, (K, V) in zip(cache.layers, kv):
            torch.testing.assert_close((layer.k, layer.v), (K, V), **PAPER_TOL)
        full, _ = paper_model(model, idx, 13)
        torch.testing.assert_close(incremental_logits(model, idx, 6), full[:, 5:], **PAPER_TOL)


# -----------------------------------------------------------------------------
# Invariant 1: training forward == prefill + decode

SIZES = {  # (model options, batch, T, prompt lengths p): several windows long, p around the
    # windows' edges; decoding runs to the end from the first p, a few steps from the others
    "w=8": (dict(), 3, 29, [1, 7, 8, 9, 17, 29]),
    "w=8, conv": (OPTIONS["conv"], 3, 29, [1, 7, 8, 9, 17, 29]),
    "w=8, llama": (LLAMA, 3, 29, [1, 7, 8, 9, 17, 29]),
    "the paper's w=128": (dict(window=128, n_embd=8, n_head=1), 2, 260, [250, 1, 126, 129]),
}


@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("size", SIZES)
def test_training_forward_equals_prefill_plus_decode(attn, size):
    """Pre-training logits at positions p-1..T-1 equal prefill(p tokens) + one-token decodes."""
    options, B, T, prompt_lengths = SIZES[size]
    model = make_model(attn, **options)
    idx = tokens(B, T)
    full, _ = model(idx)
    for p in prompt_lengths:
        inc = incremental_logits(model, idx, p, steps=None if p == prompt_lengths[0] else 4)
        torch.testing.assert_close(inc, full[:, p - 1:p - 1 + inc.size(1)], rtol=0, atol=1e-10)


@pytest.mark.parametrize("swa_impl", orthros.SWA_IMPLS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_forward_continues_a_cache_by_chunks_of_any_length(swa_impl, device):
    """Chunks of any length and t_out continuing a cache give one dense forward's logits."""
    # FlexAttention takes no float64, and heads of 16 at least. Each kernel it compiles costs
    # seconds: of these chunks only (70, 3) calls it, with 77 keys (Tq < Tk: queries padded).
    dtype = torch.float32 if swa_impl == "flex" or device == "cuda" else torch.float64
    tol = dict(rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    model = make_model(swa_impl=swa_impl, n_embd=80, n_head=5, dtype=dtype).to(device)
    dense = make_model(swa_impl="dense", n_embd=80, n_head=5, dtype=dtype).to(device)
    idx = tokens(1, 79).to(device)
    with torch.no_grad():   # (FlexAttention has no backward on the CPU)
        full, _ = dense(idx)
        cache, start = orthros.KVCache(model, 1), 0
        for n, t_out in [(2, 2), (3, 1), (2, 2), (1, 1), (70, 3), (1, 1)]:
            logits, _ = model(idx[:, start:start + n], t_out=t_out, cache=cache)
            start += n
            torch.testing.assert_close(logits, full[:, start - t_out:start], **tol)


# -----------------------------------------------------------------------------
# Invariant 2: any t_out agrees

@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("options", ["plain", "llama"])
def test_t_out_gives_the_last_rows(attn, options):
    """forward(t_out=k) equals the last k rows of forward(t_out=T)."""
    model = make_model(attn, **OPTIONS[options])
    idx = tokens(2, 21)
    full, _ = model(idx, t_out=21)
    for k in (1, 2, 7, 8, 9, 20):
        torch.testing.assert_close(model(idx, t_out=k)[0], full[:, -k:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_sft_loss_with_small_t_out_equals_full_t_out(attn):
    """The loss, mean cross-entropy of targets not -1, and its gradients agree for any t_out."""
    model = make_model(attn)
    idx, targets = tokens(2, 24), tokens(2, 24)
    targets[0, :15] = -1       # example 0: its response starts at position 15
    targets[1, :19] = -1       # example 1: at position 19
    targets[1, 21] = -1        # and a hole inside the response
    results = []
    for t_out in (24, 12, 9):  # 9 = smallest suffix that covers every target
        model.zero_grad()
        logits, loss = model(idx, targets, t_out=t_out)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    keep = targets != -1
    torch.testing.assert_close(results[0][0], F.cross_entropy(logits[keep[:, -9:]], targets[keep]))
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=0, atol=1e-12)
    assert model(idx, torch.full_like(idx, -1))[1].item() == 0.0   # no target: 0, not NaN


# -----------------------------------------------------------------------------
# Invariant 3: the window is exact, and the fast paths are the reference

def keys_seen(attend, T, n_q, window):
    """Which keys each of the last n_q of T queries mixes in: with q = 0 and value j = one-hot(j)
    (cut into heads of 16, FlexAttention's least), its output is nonzero exactly at those keys."""
    H = math.ceil(T / 16)
    q = torch.zeros(1, H, n_q, 16, dtype=torch.float64)
    k = torch.randn(1, H, T, 16, dtype=torch.float64)
    v = torch.eye(H * 16, dtype=torch.float64)[:T].reshape(T, H, 16).transpose(0, 1)[None]
    seen = attend(q, k, v.contiguous(), window)[0].transpose(0, 1).reshape(n_q, H * 16) > 0
    return [row.nonzero().flatten().tolist() for row in seen]                # (n_q, key j)


@torch.no_grad()   # (no backward on the CPU) one compiled kernel for both tests that call it
def flex(q, k, v, window):
    return flex_sliding_window_attention(q.float(), k.float(), v.float(), window)


WINDOW_CASES = {  # each path's attention, and the (keys T, queries n_q, window w) it is tried at
    "dense": (reference_attention, [(5, 5, 8), (21, 21, 8), (21, 21, None), (21, 3, 8)]),
    "blocked": (blocked_sliding_window_attention, [(5, 5, 8), (8, 8, 8), (21, 21, 8)]),
    "flex": (flex, [(300, 300, 128)]),   # over several blocks of 128
    "decode": (fast_reference_attention, [(S, 1, w) for S in (1, 8, 9, 20) for w in (8, None)]),
}


@pytest.mark.parametrize("path", WINDOW_CASES)
def test_window_is_exact(path):
    """Query t sees exactly keys t-w+1 ... t (eq. 4), or every key <= t without a window (eq. 5)."""
    attend, cases = WINDOW_CASES[path]
    for T, n_q, w in cases:
        expected = [list(range(0 if w is None else max(0, t - w + 1), t + 1))
                    for t in range(T - n_q, T)]
        assert keys_seen(attend, T, n_q, w) == expected, (T, n_q, w)


@pytest.mark.parametrize("path", ["blocked", "flex"])
def test_fast_window_equals_the_reference(path):
    """The blocked window (forward and backward) and FlexAttention's (forward) are the reference."""
    if path == "flex":   # keys_seen's shape (its compiled kernel), across blocks; w = 8: the chunks
        q, k, v = (torch.randn(1, 19, 300, 16) for _ in range(3))
        torch.testing.assert_close(flex(q, k, v, 128), reference_attention(q, k, v, 128),
                                   rtol=1e-5, atol=1e-5)
        return
    for T in (1, 7, 8, 9, 32):
        for window in (1, 3, 8):
            q, k, v = (torch.randn(2, 3, T, 4, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            dy = torch.randn(2, 3, T, 4, dtype=torch.float64)
            ref = reference_attention(q, k, v, window)
            out = blocked_sliding_window_attention(q, k, v, window)
            torch.testing.assert_close(
                (out, *torch.autograd.grad(out, (q, k, v), dy)),
                (ref, *torch.autograd.grad(ref, (q, k, v), dy)), rtol=0, atol=1e-12)


def test_flex_block_tables_are_exact():
    """FlexAttention's block tables (forward, backward) list exactly the blocks the window needs."""
    for T, window in [(77, 8), (128, 128), (129, 128), (300, 128), (700, 200), (1000, 1)]:
        mask = sliding_window_block_mask(T, window, "cpu", compute_q_blocks=True)
        n = math.ceil(T / 128)
        q, k = torch.arange(n * 128)[:, None], torch.arange(n * 128)[None]
        dense = (k <= q) & (q - k < window) & (q < T) & (k < T)            # (query, key)
        needed = dense.reshape(n, 128, n, 128).any(dim=3).any(dim=1)   # (query block, key block)
        rows = lambda num, ind: [ind[0, 0, b, :num[0, 0, b]].tolist() for b in range(n)]
        kv_rows = rows(mask.kv_num_blocks, mask.kv_indices)   # key blocks of each query block
        q_rows = rows(mask.q_num_blocks, mask.q_indices)      # query blocks of each key block
        assert kv_rows == [row.nonzero().flatten().tolist() for row in needed], (T, window)
        assert q_rows == [col.nonzero().flatten().tolist() for col in needed.T], (T, window)


# -----------------------------------------------------------------------------
# Invariant 4: the reach of each stream is bounded

@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_reach_of_each_stream(attn):
    """K, V at t depend on tokens t - L(w-1) ... t only; the logits on all (but SWA's)."""
    model = make_model(attn, n_layer=3, window=4)
    T, reach = 30, 3 * (4 - 1)                                 # L(w-1) = 9
    idx, pos = tokens(1, T), torch.arange(T)
    changed = lambda where: (idx + where) % 37                 # idx, other tokens where True
    last_kv = lambda idx: [(c.k[..., -1, :], c.v[..., -1, :]) for c in model.prefill(idx)[1].layers]
    if attn != "transformer":   # every token farther than L(w-1); one the last layer's keys reach
        far, near = pos < T - 1 - reach, pos == T - 1 - (reach - 3)
        torch.testing.assert_close(last_kv(changed(far)), last_kv(idx), rtol=0, atol=0)
        assert not torch.equal(last_kv(changed(near))[2][0], last_kv(idx)[2][0])
    last_logit = lambda idx: model(idx, t_out=1)[0]
    assert torch.equal(last_logit(changed(pos == 0)), last_logit(idx)) == (attn == "swa")


# -----------------------------------------------------------------------------
# Invariant 5: causality

@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("options", OPTIONS)
def test_causality(attn, options):
    """Changing token j changes no logits before position j (and does change the one at j)."""
    model = make_model(attn, **OPTIONS[options])
    idx = tokens(1, 26)
    logits, _ = model(idx)
    for j in [0, 5, 8, 17, 25]:
        other = idx.clone()
        other[0, j] = (other[0, j] + 1) % 37
        other_logits, _ = model(other)
        torch.testing.assert_close(other_logits[:, :j], logits[:, :j], rtol=0, atol=0)
        assert not torch.equal(other_logits[:, j], logits[:, j])


# -----------------------------------------------------------------------------
# Invariant 6: reduction to a Transformer, and the paper's conversion

@pytest.mark.parametrize("conv_kernel", [0, 3])
def test_orthros_with_full_window_equals_transformer(conv_kernel):
    """With w >= T, Orthros built from a transformer's weights (a pure copy) gives its logits."""
    transformer = make_model("transformer", conv_kernel=conv_kernel, window=32)
    orthros = make_model("orthros", conv_kernel=conv_kernel, window=32, seed=1)  # random SO
    orthros.load_transformer_weights(transformer.state_dict())
    mine = orthros.state_dict()
    assert all(torch.equal(mine[name], w) for name, w in transformer.state_dict().items())
    idx = tokens(2, 32)
    for t_out in (32, 5):
        torch.testing.assert_close(orthros(idx, t_out=t_out)[0], transformer(idx, t_out=t_out)[0],
                                   rtol=0, atol=1e-12)


def test_grouped_query_attention_is_attention_with_shared_kv_heads():
    """n_kv_head = 2 of 4 heads is multi-head attention whose K, V heads 2g and 2g+1 copy head g."""
    grouped, full = make_model(**LLAMA), make_model(**{**LLAMA, "n_kv_head": None})
    state = grouped.state_dict()
    for name, w in state.items():
        if ".c_k." in name or ".c_v." in name:   # (2 * D, ...) -> (4 * D, ...): each head twice
            state[name] = w.unflatten(0, (2, -1)).repeat_interleave(2, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    idx = tokens(2, 19)
    torch.testing.assert_close(full(idx)[0], grouped(idx)[0], rtol=0, atol=1e-12)
    k = grouped.prefill(idx)[1].layers[0].k
    assert k.shape == (2, 2, 19, LLAMA["head_dim"])   # the cache holds the 2 K, V heads only


# -----------------------------------------------------------------------------
# Generation

@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_greedy_generation_streams_the_argmax_of_full_forwards(attn):
    """Greedy generate_tokens yields full forwards' argmax, each token after its decode step."""
    model, calls = make_model(attn), []

    class Counting:   # the model's own decoder, counting its calls
        prefill = lambda self, idx: calls.append("prefill") or model.prefill(idx)
        decode = lambda self, token, state: calls.append("decode") or model.decode(token, state)

    ref = idx = tokens(2, 5)
    for _ in range(6):
        ref = torch.cat([ref, model(ref, t_out=1)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    gen = [(len(calls), token) for token in model.generate_tokens(idx, 6, 0, decoder=Counting())]
    assert [n for n, _ in gen] == [1, 2, 3, 4, 5, 6] and calls == ["prefill"] + ["decode"] * 5
    assert torch.equal(torch.cat([idx] + [token for _, token in gen], 1), ref)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, None), (1.0, 3)])
def test_sample_draws_from_the_softmax_of_the_top_k(temperature, top_k):
    """Tokens come as often as softmax(logits / temperature) over the top k says."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    torch.manual_seed(0)
    draws = orthros.sample_next(logits.expand(40000, 1, -1), temperature, top_k)   # (40000, 1)
    p = torch.softmax(logits / temperature, dim=-1)
    if top_k is not None:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
        p = p / p.sum()
    freq = torch.bincount(draws.flatten(), minlength=len(logits)) / len(draws)
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / 40000).sqrt())   # 4 sigma; 0 is 0


# -----------------------------------------------------------------------------
# Bad input: a ValueError of one line that names the problem

Z = lambda *shape: torch.zeros(*shape, dtype=torch.long)
BAD = {  # each call on a model of max_seq_len 16, and the word its error names
    "t_out 0": (lambda m: m(Z(2, 10), t_out=0), "t_out"),
    "t_out > T": (lambda m: m(Z(2, 10), t_out=11), "t_out"),
    "a target before t_out": (lambda m: m(Z(2, 10), Z(2, 10), t_out=3), "t_out"),
    "forward past max_seq_len": (lambda m: m(Z(1, 17)), "max_seq_len"),
    "prefill past max_seq_len": (lambda m: m.prefill(Z(1, 17)), "max_seq_len"),
    "generate past max_seq_len": (lambda m: m.generate(Z(1, 10), 7), "max_seq_len"),
    "decode past max_seq_len": (lambda m: m.decode(Z(1), m.prefill(Z(1, 16))[1]), "max_seq_len"),
    "another model's cache": (lambda m: m.decode(Z(2), make_model().prefill(Z(2, 5))[1]), "cache"),
    "another batch size": (lambda m: m.decode(Z(3), m.prefill(Z(2, 5))[1]), "batch"),
    "temperature < 0": (lambda m: m.generate(Z(1, 5), 3, temperature=-0.5), "temperature"),
    "top_k 0": (lambda m: next(m.generate_tokens(Z(1, 5), 3, top_k=0)), "top_k"),
    "weights of another size": (lambda m: m.load_transformer_weights(
        make_model("transformer", n_embd=32).state_dict()), "another size"),
    "attn": (lambda m: OrthrosConfig(attn="linear"), "attn"),
    "n_head": (lambda m: OrthrosConfig(n_embd=10, n_head=3), "n_head"),
    "window 0": (lambda m: OrthrosConfig(window=0), "window"),
    "n_kv_head": (lambda m: OrthrosConfig(n_head=6, n_kv_head=4), "n_kv_head"),
    "mlp": (lambda m: OrthrosConfig(mlp="relu"), "mlp"),
    "rope_scaling": (lambda m: OrthrosConfig(rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
    "llama3 keys": (lambda m: OrthrosConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                    "rope_scaling"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_naming_it(case):
    """Each bad input is refused with a one-line ValueError that names what is wrong."""
    call, word = BAD[case]
    with pytest.raises(ValueError, match=word) as e:
        call(make_model(max_seq_len=16))
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# The GPU paths (bf16, SDPA's fused kernels), held to the float64 references

def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@cuda
@pytest.mark.parametrize("impl", ["blocked", "flex"])
@pytest.mark.parametrize("T", [64, 128, 192, 320, 1000])
@pytest.mark.parametrize("window", [32, 128])
def test_cuda_fast_swa_matches_float64_reference(impl, T, window):
    """On the GPU in bf16, both fast windows match the float64 reference, forward and backward."""
    torch.manual_seed(T)
    q, k, v, dy = (torch.randn(2, 6, T, 128, device="cuda") for _ in range(4))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref, window)
    ref_grads = torch.autograd.grad(ref_out, ref, dy.double())
    fast = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    swa = flex_sliding_window_attention if impl == "flex" else blocked_sliding_window_attention
    out = swa(*fast, window)
    grads = torch.autograd.grad(out, fast, dy.bfloat16())
    assert rel_err(out, ref_out) < 1e-2
    for g, g_ref in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, g_ref) < 2e-2


@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_cuda_bf16_model_matches_float64_and_decodes_consistently(attn, compiled):
    """A bf16 model on the GPU matches its float64 CPU twin, and prefill + decode its forward."""
    shape = dict(window=128, n_layer=2, n_embd=256, n_head=2, vocab_size=97)
    model = make_model(attn, **shape)
    idx = torch.randint(0, 97, (2, 400))
    ref, _ = model(idx)
    gpu = make_model(attn, dtype=torch.bfloat16, **shape)
    gpu.load_state_dict(model.state_dict())
    gpu = gpu.cuda()
    if compiled:
        compile_blocks(gpu)
    logits, _ = gpu(idx.cuda())
    assert rel_err(logits, ref) < 2e-2
    assert rel_err(incremental_logits(gpu, idx.cuda(), 300), logits[:, 299:]) < 2e-2
    gpu.train()
    gpu(idx.cuda(), idx.cuda())[1].backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())
