"""
What the tests prove: Orthros attention (paper section 3, Algorithms 1 and 2, equations 4
and 5) as a specification, each property in plain words:

0. The model is the paper's. Its logits equal a literal reference of Algorithms 1 and 2 written
   here from the paper, with RoPE as complex rotations, random weights and four distinct
   scale-offsets, in every regime; its KV cache equals the reference's base stream. It starts
   from GPT-2's init, the projections into the residual stream scaled by 1/sqrt(2 n_layer).
1. Training equals prefill plus decode. The logits of one pre-training forward (t_out = T) at
   positions p-1 ... T-1 equal those of prefill on the first p tokens followed by one-token
   decode steps, for sequences several windows long, batch > 1 and several p; and those of
   a cache continued by chunks of any length, on every swa_impl.
2. Any t_out gives the last rows. forward(t_out=k) is the last k rows of forward(t_out=T),
   and the SFT loss and its gradients with a small t_out equal those with t_out = T.
3. The window is exact, and defined once. Query t sees key t-w+1 and not key t-w: in the dense
   reference, the blocked and the FlexAttention paths and the decode slice, all built from
   (or checked against) one predicate, in_window; patching it changes the paths built from it.
4. The reach of each stream is bounded. After L layers the base stream (the KV cache) at t
   depends only on tokens t - L(w-1) ... t; the output stream at t depends on every token <= t.
5. Causality. Changing token j changes no logits before position j.
6. The model reduces to a Transformer. With w >= T and identity scale-offset, Orthros built
   from a Transformer's weights gives the Transformer's logits; the conversion is a pure
   weight copy.

Run: python -m pytest -q test_orthros.py
CPU, float64 where exactness is the point, tiny shapes. The tests marked `cuda` run the GPU
paths against the same references and skip only where there is no GPU.
"""

import math

import pytest
import torch

import orthros
from orthros import (ATTN_TYPES, SCALE_OFFSETS, Orthros, OrthrosConfig, attention_mask, blocked_sliding_window_attention,
                     causal_depthwise_conv, compile_blocks, fast_reference_attention, flex_sliding_window_attention,
                     in_window, reference_attention, sliding_window_block_mask)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_model(attn="orthros", seed=0, dtype=torch.float64, randomize=True, **overrides):
    """A tiny model in float64. randomize=True moves the scale-offsets (and the optional
    convolution) off their identity start, so the tests can tell the two streams apart."""
    kw = dict(vocab_size=37, n_layer=2, n_head=2, n_embd=16, window=8, attn=attn, max_seq_len=512)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Orthros(OrthrosConfig(**kw)).to(dtype).eval()
    if randomize:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.split(".")[-1] in SCALE_OFFSETS or ".conv." in name:
                    p.add_(0.5 * torch.randn_like(p))
    return model


def randomize_all(model, std=0.3):
    """Move every weight off its initial value (norm gains, scale-offsets, matrices), each by its own draw."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    return model


def incremental_logits(model, idx, p, steps=None):
    """Logits at positions p-1 ... T-1 from prefill(idx[:, :p]) and then one decode step per token
    (or only the first `steps` of them)."""
    logits, cache = model.prefill(idx[:, :p])
    out = [logits]
    for t in range(p, idx.size(1) if steps is None else min(idx.size(1), p + steps)):
        logits, cache = model.decode(idx[:, t], cache)
        out.append(logits)
    return torch.cat(out, dim=1)


# -----------------------------------------------------------------------------
# Invariant 0: the model is the paper's. The reference below is written from the paper's section 3
# (Algorithms 1 and 2, equations 4 and 5), one sequence and one query at a time, sharing no code
# with orthros.py; it reads only the model's weights. Where the paper leaves a choice open, it makes
# orthros.py's documented ones: RMSNorm, a GELU MLP, RoPE, the LM head tied to the embedding.

def rope_as_complex(x, positions, base):
    """RoPE (RoFormer, Su et al. 2021): each pair of a head's D channels is a complex number, and pair i
    turns by the angle position * base^(-2i/D). The pairs are channels (i, i + D/2), the half-split
    layout of Llama's Hugging Face code (Meta's own code pairs 2i, 2i+1). x: (rows, H, D), positions: (rows,)."""
    D = x.size(-1)
    pairs = torch.complex(x[..., :D // 2], x[..., D // 2:])                        # (rows, H, D/2)
    theta = base ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)          # (D/2,)
    turned = pairs * torch.exp(1j * positions.double()[:, None, None] * theta)    # times e^(i t theta_i)
    return torch.cat([turned.real, turned.imag], dim=-1)


def paper_attention(X, T, attn, w, H, base):
    """Algorithm 1 for one sequence. X: (T + T_out, d), T base tokens then T_out output tokens; attn holds
    W_Q, W_K, W_V, W_O (as nn.Linear: x W = x @ weight.T) and alpha, beta, alpha', beta'. Returns Y, K, V."""
    T_out = len(X) - T
    W_Q, W_K, W_V, W_O = (linear.weight.T for linear in (attn.c_q, attn.c_k, attn.c_v, attn.c_proj))
    X, X_cross = X[:T], X[T:]                                                     # line 3
    K, V = X @ W_K, X @ W_V                                                       # line 4
    Q, Q_cross = attn.alpha * (X @ W_Q) + attn.beta, attn.alpha_out * (X_cross @ W_Q) + attn.beta_out  # line 5
    heads = lambda M: M.reshape(len(M), H, M.size(-1) // H)                       # lines 6-7: (rows, H, d_h)
    Q, K, V, Q_cross = heads(Q), heads(K), heads(V), heads(Q_cross)
    # RoPE, which Algorithm 1 leaves implicit: queries (after line 5) and keys turn by their positions,
    # an output token by its base twin's.
    pos = torch.arange(T)
    Q, K = rope_as_complex(Q, pos, base), rope_as_complex(K, pos, base)
    Q_cross = rope_as_complex(Q_cross, pos[T - T_out:], base)

    def o(q, t, first):  # eq. 4 and 5: q_t attends keys first ... t, softmax(q_t k_j / sqrt(d_h)) weighs v_j
        weights = torch.softmax(torch.einsum("hd,jhd->hj", q, K[first:t + 1]) / math.sqrt(q.size(-1)), dim=-1)
        return torch.einsum("hj,jhd->hd", weights, V[first:t + 1])

    O = [o(Q[t], t, max(0, t - w + 1)) for t in range(T)]                         # line 8: window w (eq. 4)
    O_cross = [o(Q_cross[i], t, 0) for i, t in enumerate(range(T - T_out, T))]    # line 9: every key j <= t (eq. 5)
    O = torch.stack(O + O_cross).flatten(1)                                       # lines 10-11: (T + T_out, d)
    return O @ W_O, K, V                                                          # line 12


def paper_model(model, idx, T_out):
    """Algorithm 2 for each sequence of idx: (B, T), then the LM head. Returns the logits (B, T_out, vocab) and,
    per layer, the base stream's keys and values (B, H, T, d_h): what the KV cache must hold."""
    c = model.config
    rms_norm = lambda x, g: x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps) * g
    gelu = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    logits, kv = [], [[] for _ in model.blocks]
    for seq in idx:
        T, X = len(seq), model.wte.weight[seq]                                    # (T, d)
        Z = torch.cat([X, X[T - T_out:]])                                         # line 2: duplicate T_out tokens
        for layer, block in enumerate(model.blocks):                              # line 3
            A, K, V = paper_attention(rms_norm(Z, block.ln_1.weight), T, block.attn, c.window, c.n_head, c.rope_base)
            Z = Z + A                                                             # lines 4-5
            Z = Z + gelu(rms_norm(Z, block.ln_2.weight) @ block.mlp.c_fc.weight.T) @ block.mlp.c_proj.weight.T  # 6-7
            kv[layer].append((K.transpose(0, 1), V.transpose(0, 1)))
        Y = rms_norm(Z[T:], model.ln_f.weight)                                    # lines 9-10: output tokens only
        logits.append(Y @ model.lm_head.weight.T)
    return torch.stack(logits), [[torch.stack(t) for t in zip(*layer)] for layer in kv]


# NOTE: orthros.py makes its RoPE tables in float32 (as Llama's Hugging Face code does, which the
# conversion matches), so the float64 model agrees with this float64 reference to ~1e-6, not 1e-12.
# Every departure from the paper we tried moves the logits by more than 1e-2.
PAPER_TOL = dict(rtol=0, atol=1e-5)


def test_rope_is_a_complex_rotation():
    """orthros's RoPE turns channel pair (i, i + D/2) at position t by t * base^(-2i/D), as complex numbers."""
    torch.manual_seed(0)
    x, positions = torch.randn(2, 3, 50, 8, dtype=torch.float64), torch.arange(50)
    cos, sin = orthros.rope_cos_sin(positions, 8, 10000.0, torch.float64)
    expected = rope_as_complex(x.transpose(1, 2).flatten(0, 1), positions.repeat(2), 10000.0)  # rows (B * T, H, D)
    expected = expected.unflatten(0, (2, 50)).transpose(1, 2)                                   # (B, H, T, D)
    torch.testing.assert_close(orthros.apply_rope(x, cos, sin), expected, **PAPER_TOL)


@pytest.mark.parametrize("window", [3, 12, 20], ids=["w=3", "w=T-1", "w>T"])
def test_model_is_the_papers_algorithms(window):
    """With random weights and distinct alpha, beta, alpha', beta', the logits equal Algorithms 1 and 2 written out,
    for t_out = T (pre-training), 5 (SFT), 1 (prefill) and in decoding; the KV cache is the base stream (t_out = 0)."""
    model = randomize_all(make_model(window=window))
    attn = model.blocks[0].attn
    assert all(not torch.equal(a, b) for a, b in [(attn.alpha, attn.alpha_out), (attn.beta, attn.beta_out)])
    idx = torch.randint(0, 37, (2, 13))
    with torch.no_grad():
        for t_out in (13, 5, 1):
            torch.testing.assert_close(model(idx, t_out=t_out)[0], paper_model(model, idx, t_out)[0], **PAPER_TOL)
        _, kv = paper_model(model, idx, 0)
        _, cache = model.prefill(idx)
        for layer, (K, V) in zip(cache.layers, kv):
            torch.testing.assert_close(layer.k, K, **PAPER_TOL)
            torch.testing.assert_close(layer.v, V, **PAPER_TOL)
        full, _ = paper_model(model, idx, 13)
        torch.testing.assert_close(incremental_logits(model, idx, 6), full[:, 5:], **PAPER_TOL)


def test_residual_projections_start_scaled_down():
    """GPT-2's init, as nanoGPT's: linear and embedding weights ~ N(0, 0.02), but the projections into the residual
    stream (attention's and the MLP's c_proj) ~ N(0, 0.02 / sqrt(2 n_layer)); norms and scale-offsets at identity."""
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(vocab_size=512, n_layer=8, n_head=4, n_embd=128))
    for name, p in model.named_parameters():
        if p.dim() == 1:
            start = 0.0 if name.rsplit(".", 1)[-1] in ("beta", "beta_out") else 1.0
            assert torch.equal(p, torch.full_like(p, start)), name
            continue
        std = 0.02 / math.sqrt(2 * 8) if name.endswith("c_proj.weight") else 0.02
        assert abs(p.std().item() / std - 1) < 0.05 and abs(p.mean().item()) < 0.05 * std, name


# -----------------------------------------------------------------------------
# Invariant 1: training forward == prefill + decode

SIZES = {  # (model options, batch, T, prompt lengths p): several windows long, p around the windows' edges;
    # decoding runs to the end from the first p (across the edges), a few steps from the others
    "w=8": (dict(), 3, 29, [1, 2, 7, 8, 9, 17, 28, 29]),
    "w=8, conv 3": (dict(conv_kernel=3), 3, 29, [1, 2, 7, 8, 9, 17, 28, 29]),
    "the paper's w=128": (dict(window=128, n_embd=8, n_head=1), 2, 300, [120, 1, 128, 129, 257, 300]),
}


@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("size", SIZES)
def test_training_forward_equals_prefill_plus_decode(attn, size):
    """Pre-training logits at positions p-1..T-1 equal prefill(p tokens) + one-token decode steps."""
    options, B, T, prompt_lengths = SIZES[size]
    model = make_model(attn, **options)
    idx = torch.randint(0, 37, (B, T))
    full, _ = model(idx)
    for p in prompt_lengths:  # from the first prompt length to the end; from the others, a few steps
        inc = incremental_logits(model, idx, p, steps=None if p == prompt_lengths[0] else 4)
        torch.testing.assert_close(inc, full[:, p - 1:p - 1 + inc.size(1)], rtol=0, atol=1e-10)


@pytest.mark.parametrize("swa_impl", orthros.SWA_IMPLS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_forward_continues_a_cache_by_chunks_of_any_length(swa_impl, device):
    """With a cache, forward takes chunks of any length and t_out (shorter and longer than the window, one-token
    decode steps) on every swa_impl: their logits are those of one pre-training forward with the dense reference."""
    dtype = torch.float32 if swa_impl == "flex" or device == "cuda" else torch.float64  # FlexAttention takes no float64
    tol = dict(rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    # 5 heads of 16 (flex's least), one sequence, and (below) every windowed call 77 keys long: the shape of
    # test_flex_swa_equals_dense_reference, so that one compiled FlexAttention kernel serves both
    model = make_model(swa_impl=swa_impl, n_embd=80, n_head=5, dtype=dtype).to(device)
    dense = make_model(swa_impl="dense", n_embd=80, n_head=5, dtype=dtype).to(device)
    idx = torch.randint(0, 37, (1, 150), device=device)
    with torch.no_grad():   # (FlexAttention has no backward on the CPU)
        full, _ = dense(idx)
        cache, start = orthros.KVCache(model, 1), 0
        for n, t_out in [(2, 2), (3, 1), (2, 2), (70, 70), (1, 1), (70, 3), (2, 2)]:
            logits, _ = model(idx[:, start:start + n], t_out=t_out, cache=cache)
            start += n
            torch.testing.assert_close(logits, full[:, start - t_out:start], **tol)


# -----------------------------------------------------------------------------
# Invariant 2: any t_out agrees

@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_t_out_gives_the_last_rows(attn):
    """forward(t_out=k) equals the last k rows of forward(t_out=T), for every k."""
    model = make_model(attn)
    idx = torch.randint(0, 37, (2, 21))
    full, _ = model(idx, t_out=21)
    for k in range(1, 22):
        logits, _ = model(idx, t_out=k)
        assert logits.shape == (2, k, 37)
        torch.testing.assert_close(logits, full[:, -k:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_sft_loss_with_small_t_out_equals_full_t_out(attn):
    """The SFT loss and its gradients with a small t_out equal those with t_out = T and the same ignore mask."""
    model = make_model(attn)
    idx = torch.randint(0, 37, (2, 24))
    targets = torch.randint(0, 37, (2, 24))
    targets[0, :15] = -1       # example 0: its response starts at position 15
    targets[1, :19] = -1       # example 1: at position 19
    targets[1, 21] = -1        # and a hole inside the response
    losses, grads = [], []
    for t_out in (9, 12, 24):  # 9 = smallest suffix that covers every target
        model.zero_grad()
        _, loss = model(idx, targets, t_out=t_out)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    for loss, grad in zip(losses[1:], grads[1:]):
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=1e-12)
        for g, g0 in zip(grad, grads[0]):
            torch.testing.assert_close(g, g0, rtol=0, atol=1e-12)


def test_loss_is_the_mean_over_non_ignored_targets():
    """loss is the mean cross-entropy over exactly the non-ignored targets, and 0 (not NaN) when all are ignored."""
    model = make_model()
    idx = torch.randint(0, 37, (2, 10))
    targets = torch.randint(0, 37, (2, 10))
    targets[0, 3] = -1
    logits, loss = model(idx, targets)
    keep = targets != -1
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)
    _, loss = model(idx, torch.full_like(idx, -1))
    assert loss.item() == 0.0


# -----------------------------------------------------------------------------
# Invariant 3: the window is exact, and defined once (in_window)

def keys_seen(attend, T, w, n_q=None):
    """Which keys each of the last n_q (default T) queries mixes in: with equal scores (q = 0)
    and value j = one-hot(j), a query's output is nonzero exactly at the keys it attends. The
    one-hots are cut into heads of 16 (FlexAttention's smallest head size): key j is dimension
    j % 16 of head j // 16, and every head attends the same keys."""
    n_q = T if n_q is None else n_q
    H = math.ceil(T / 16)
    q = torch.zeros(1, H, n_q, 16, dtype=torch.float64)
    k = torch.randn(1, H, T, 16, dtype=torch.float64)
    v = torch.eye(H * 16, dtype=torch.float64)[:T].reshape(T, H, 16).transpose(0, 1)[None].contiguous()  # (1, H, T, 16)
    seen = attend(q, k, v, w)[0].transpose(0, 1).reshape(n_q, H * 16) > 0                    # (n_q, key j)
    return [row.nonzero().flatten().tolist() for row in seen]


def flex_swa(q, k, v, window):
    return flex_sliding_window_attention(q, k, v, window)


def test_in_window_is_the_paper_window():
    """in_window(t, j, w) holds exactly for t-w < j <= t (eq. 4), and for every j <= t without a window (eq. 5)."""
    t, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    for w in (1, 3, 8, 20):
        assert torch.equal(in_window(t, j, w), (t - w < j) & (j <= t))
    assert torch.equal(in_window(t, j, None), j <= t)


@pytest.mark.parametrize("swa", [reference_attention, blocked_sliding_window_attention],
                         ids=["dense", "blocked"])
@pytest.mark.parametrize("T", [5, 8, 21])
def test_window_boundary_is_exact(swa, T):
    """Position t sees exactly keys t-w+1 ... t: key t-w+1 is seen, key t-w is not."""
    w = 8
    seen = keys_seen(swa, T, w)
    for t in range(T):
        assert seen[t] == list(range(max(0, t - w + 1), t + 1))


def test_window_boundary_is_exact_flex():
    """The same boundary for the FlexAttention window (compiled, here on the CPU), over several blocks of 128."""
    T, w = 300, 128
    seen = keys_seen(lambda q, k, v, w: flex_swa(q.float(), k.float(), v.float(), w), T, w)
    for t in range(T):
        assert seen[t] == list(range(max(0, t - w + 1), t + 1))


@pytest.mark.parametrize("S", [1, 5, 8, 9, 20])
@pytest.mark.parametrize("window", [8, None])
def test_decode_reads_exactly_the_window(S, window):
    """The single-query decode path at t = S-1 reads exactly the keys {j : in_window(t, j, w)} (the last w, or all)."""
    seen = keys_seen(lambda q, k, v, w: fast_reference_attention(q, k, v, w), S, window, n_q=1)[0]
    assert seen == [j for j in range(S) if in_window(S - 1, j, window)]


def test_patched_in_window_changes_dense_and_blocked(monkeypatch):
    """Patching orthros.in_window (here off by one: q - k <= w) changes the dense and the blocked paths alike."""
    torch.manual_seed(0)
    T, w = 21, 4
    q, k, v = (torch.randn(2, 3, T, 4, dtype=torch.float64) for _ in range(3))
    dense, blocked = reference_attention(q, k, v, w), blocked_sliding_window_attention(q, k, v, w)
    wider = reference_attention(q, k, v, w + 1)  # the window the patched predicate describes

    def off_by_one(q_pos, k_pos, window):  # a student's slip: <= where the paper has <
        causal = k_pos <= q_pos
        return causal if window is None else causal & (q_pos - k_pos <= window)

    monkeypatch.setattr(orthros, "in_window", off_by_one)
    for swa, before in [(reference_attention, dense), (blocked_sliding_window_attention, blocked)]:
        after = swa(q, k, v, w)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, wider, rtol=0, atol=1e-12)


def test_attention_mask_is_bottom_right_aligned():
    """With fewer queries than keys, queries are the last positions: the last query sees every key."""
    mask = attention_mask(2, 5)
    assert mask.tolist() == [[True, True, True, True, False], [True] * 5]
    assert attention_mask(3, 5, window=2).tolist() == [[False, True, True, False, False],
                                                       [False, False, True, True, False],
                                                       [False, False, False, True, True]]


@pytest.mark.parametrize("T", [1, 5, 7, 8, 9, 19, 32])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_blocked_swa_equals_dense_reference(T, window):
    """The blockwise sliding window equals the dense-mask reference, forward and backward."""
    torch.manual_seed(T * 10 + window)
    q, k, v = (torch.randn(2, 3, T, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dy = torch.randn(2, 3, T, 4, dtype=torch.float64)
    ref = reference_attention(q, k, v, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    out = blocked_sliding_window_attention(q, k, v, window)
    out_grads = torch.autograd.grad(out, (q, k, v), dy)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(out_grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("T,window", [(77, 8), (300, 128)])
def test_flex_swa_equals_dense_reference(T, window):
    """The FlexAttention window (compiled, on the CPU) equals the dense reference, in one block of 128 keys and
    across three. (Its block tables at more sizes: test_flex_block_tables_are_exact. The shapes are keys_seen's,
    so that two compiled kernels serve every flex test here: each new shape costs seconds of compiling.)"""
    torch.manual_seed(T)
    q, k, v = (torch.randn(1, math.ceil(T / 16), T, 16) for _ in range(3))
    torch.testing.assert_close(flex_swa(q, k, v, window), reference_attention(q, k, v, window),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,window", [(77, 8), (128, 128), (129, 128), (300, 128), (700, 200), (1000, 64), (1000, 1)])
def test_flex_block_tables_are_exact(T, window):
    """The block tables (forward and backward side) list exactly the block pairs that hold a pair in the window."""
    mask = sliding_window_block_mask(T, window, "cpu", compute_q_blocks=True)
    n = math.ceil(T / 128)
    dense = torch.zeros(n * 128, n * 128, dtype=torch.bool)
    dense[:T, :T] = attention_mask(T, T, window)
    needed = dense.reshape(n, 128, n, 128).any(dim=3).any(dim=1)          # (query block, key block)
    kv_rows = [mask.kv_indices[0, 0, b, :mask.kv_num_blocks[0, 0, b]].tolist() for b in range(n)]
    q_rows = [mask.q_indices[0, 0, c, :mask.q_num_blocks[0, 0, c]].tolist() for c in range(n)]
    assert kv_rows == [needed[b].nonzero().flatten().tolist() for b in range(n)]     # key blocks of query block b
    assert q_rows == [needed[:, c].nonzero().flatten().tolist() for c in range(n)]   # query blocks of key block c


def test_flex_block_table_size_is_linear_in_T():
    """The block tables grow as O(T / 128), not O((T / 128)^2): 2 key blocks per query block for w = 128."""
    T, n = 128 * 64, 64
    on_gpu = sliding_window_block_mask(T, 128, "meta", compute_q_blocks=True)  # "meta" stands in for a GPU
    assert on_gpu.kv_indices.numel() <= 2 * n and on_gpu.q_indices.numel() <= 2 * n
    on_cpu = sliding_window_block_mask(T, 128, "cpu", compute_q_blocks=True)  # a wide view, narrow storage
    assert on_cpu.kv_indices.untyped_storage().nbytes() <= 3 * n * 4
    assert on_cpu.kv_num_blocks.numel() == n and on_cpu.q_indices.numel() <= 2 * n


@pytest.mark.parametrize("attn", ["orthros", "swa"])
def test_blocked_and_dense_models_agree(attn):
    """A whole model gives the same logits and gradients with swa_impl 'blocked' and 'dense'."""
    blocked = make_model(attn)
    dense = make_model(attn, swa_impl="dense")
    dense.load_state_dict(blocked.state_dict())
    idx = torch.randint(0, 37, (2, 27))
    for model in (blocked, dense):
        model.zero_grad()
        model(idx, idx)[1].backward()
    torch.testing.assert_close(blocked(idx)[0], dense(idx)[0], rtol=0, atol=1e-12)
    for pb, pd in zip(blocked.parameters(), dense.parameters()):
        torch.testing.assert_close(pb.grad, pd.grad, rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# Invariant 4: the reach of each stream is bounded

@pytest.mark.parametrize("attn", ["orthros", "swa"])
def test_base_stream_is_local(attn):
    """The keys and values at position t depend only on tokens t - L(w-1) ... t."""
    model = make_model(attn, n_layer=3, window=4)             # L(w-1) = 9
    T, reach = 30, 3 * (4 - 1)
    idx = torch.randint(0, 37, (1, T))
    _, cache = model.prefill(idx)
    far = idx.clone()
    far[0, : T - 1 - reach] = (far[0, : T - 1 - reach] + 1) % 37  # every token farther back than L(w-1)
    _, cache_far = model.prefill(far)
    for layer in range(3):
        torch.testing.assert_close(cache_far.layers[layer].k[..., -1, :], cache.layers[layer].k[..., -1, :], rtol=0, atol=0)
        torch.testing.assert_close(cache_far.layers[layer].v[..., -1, :], cache.layers[layer].v[..., -1, :], rtol=0, atol=0)
    near = idx.clone()
    near[0, T - 1 - (reach - 3)] = (near[0, T - 1 - (reach - 3)] + 1) % 37  # the last layer's keys reach (L-1)(w-1)
    _, cache_near = model.prefill(near)
    assert not torch.equal(cache_near.layers[2].k[..., -1, :], cache.layers[2].k[..., -1, :])


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_output_stream_is_global(attn):
    """Token 0 changes the last logit for orthros and transformer, far beyond the window; not for swa."""
    model = make_model(attn, n_layer=2, window=4)
    idx = torch.randint(0, 37, (1, 40))
    other = idx.clone()
    other[0, 0] = (other[0, 0] + 1) % 37
    changed = not torch.equal(model(idx, t_out=1)[0], model(other, t_out=1)[0])
    assert changed == (attn != "swa")


def test_base_stream_never_sees_the_output_stream():
    """Orthros's base stream (its K/V cache) is exactly an SWA model's with the same weights: keys
    and values come from base tokens only, whatever the output tokens' scale-offset."""
    orthros = make_model("orthros")
    swa = make_model("swa")
    swa.load_state_dict(orthros.state_dict(), strict=False)
    with torch.no_grad():
        for block in orthros.blocks:            # identity base query, random output query
            block.attn.alpha.fill_(1.0)
            block.attn.beta.zero_()
    idx = torch.randint(0, 37, (2, 30))
    _, cache_o = orthros.prefill(idx)
    _, cache_s = swa.prefill(idx)
    assert cache_o.layers[0].k.shape == (2, 2, 30, 8)  # T positions: output tokens add no keys
    for layer in range(2):
        torch.testing.assert_close(cache_o.layers[layer].k, cache_s.layers[layer].k, rtol=0, atol=1e-12)
        torch.testing.assert_close(cache_o.layers[layer].v, cache_s.layers[layer].v, rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# Invariant 5: causality

@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("conv_kernel", [0, 3])
def test_causality(attn, conv_kernel):
    """Changing token j changes no logits before position j (and does change the one at j)."""
    model = make_model(attn, conv_kernel=conv_kernel)
    idx = torch.randint(0, 37, (1, 26))
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
    """With w >= T and identity scale-offset, Orthros built from a transformer's weights gives its logits."""
    transformer = make_model("transformer", conv_kernel=conv_kernel, window=32)
    orthros = make_model("orthros", conv_kernel=conv_kernel, window=32, seed=1)
    orthros.load_transformer_weights(transformer.state_dict())
    idx = torch.randint(0, 37, (2, 32))
    torch.testing.assert_close(orthros(idx)[0], transformer(idx)[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(orthros(idx, t_out=5)[0], transformer(idx, t_out=5)[0], rtol=0, atol=1e-12)


def test_conversion_is_a_pure_weight_copy():
    """Orthros's parameters are a Transformer's plus alpha, beta, alpha', beta' per layer (none w/o SO or for
    SWA): a transformer state dict loads into it by name, and the scale-offsets start at identity."""
    names = lambda attn, so=True: set(make_model(attn, scale_offset=so).state_dict())
    assert names("orthros", False) == names("swa") == names("transformer")
    transformer = make_model("transformer")
    orthros = make_model("orthros", seed=1)                 # randomized scale-offsets
    orthros.load_transformer_weights(transformer.state_dict())
    sd_o = orthros.state_dict()
    for name, w in transformer.state_dict().items():
        assert torch.equal(sd_o[name], w)
    extra = set(sd_o) - set(transformer.state_dict())
    assert extra == {f"blocks.{i}.attn.{n}" for i in range(2) for n in SCALE_OFFSETS}
    for name in extra:
        assert torch.all(sd_o[name] == (1.0 if "alpha" in name else 0.0)) and sd_o[name].shape == (16,)
    fresh = make_model("orthros", randomize=False).state_dict()   # a new model starts at identity too
    assert all(torch.all(fresh[name] == (1.0 if "alpha" in name else 0.0)) for name in extra)


def test_conversion_rejects_a_model_of_another_size():
    """Loading weights of another shape fails with a message that names the problem."""
    orthros = make_model("orthros")
    with pytest.raises(ValueError, match="another size"):
        orthros.load_transformer_weights(make_model("transformer", n_embd=32).state_dict())


# -----------------------------------------------------------------------------
# Generation

@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_greedy_generate_equals_argmax_of_full_forwards(attn):
    """generate(temperature=0) through the KV cache equals the greedy argmax of repeated full forwards."""
    model = make_model(attn)
    idx = torch.randint(0, 37, (2, 5))
    out = model.generate(idx, 25, temperature=0)
    ref = idx
    for _ in range(25):
        logits, _ = model(ref, t_out=1)
        ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_sampling_respects_top_k():
    """With top_k=1, sampling at any temperature is greedy."""
    model = make_model()
    idx = torch.randint(0, 37, (2, 5))
    assert torch.equal(model.generate(idx, 10, temperature=2.0, top_k=1), model.generate(idx, 10, temperature=0))


class CountingDecoder:
    """A decoder that records every call, and delegates to the model's own prefill and decode."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def prefill(self, idx):
        self.calls.append("prefill")
        return self.model.prefill(idx)

    def decode(self, next_idx, state):
        self.calls.append("decode")
        return self.model.decode(next_idx, state)


def test_generate_tokens_yields_after_prefill_and_each_decode_step():
    """generate_tokens yields (B, 1) tokens: first after prefill, then one per decode step, no decode after the last."""
    model = make_model()
    idx = torch.randint(0, 37, (2, 5))
    decoder = CountingDecoder(model)
    calls_at_yield = []
    for token in model.generate_tokens(idx, 4, temperature=0, decoder=decoder):
        assert token.shape == (2, 1)
        calls_at_yield.append(list(decoder.calls))
    assert calls_at_yield == [["prefill"], ["prefill", "decode"], ["prefill"] + ["decode"] * 2,
                              ["prefill"] + ["decode"] * 3]
    assert decoder.calls == ["prefill"] + ["decode"] * 3
    assert torch.equal(model.generate(idx, 4, temperature=0, decoder=CountingDecoder(model)),
                       model.generate(idx, 4, temperature=0))


def test_bad_sampling_settings_are_rejected():
    """A negative temperature or a top_k below 1 is an error that names it."""
    model = make_model()
    idx = torch.randint(0, 37, (1, 5))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 3, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k"):
        next(model.generate_tokens(idx, 3, top_k=0))


# -----------------------------------------------------------------------------
# Clear errors on bad input

def test_bad_t_out_is_rejected():
    """t_out < 1 or > T is an error that names t_out."""
    model = make_model()
    idx = torch.randint(0, 37, (2, 10))
    for t_out in (0, -1, 11):
        with pytest.raises(ValueError, match="t_out"):
            model(idx, t_out=t_out)


def test_too_long_sequences_are_rejected():
    """Sequences longer than max_seq_len are refused in forward, prefill, decode and generate."""
    model = make_model(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    _, cache = model.prefill(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.decode(torch.zeros(1, dtype=torch.long), cache)


def test_targets_outside_output_positions_are_rejected():
    """A target other than -1 before the output positions is an error, never silently dropped. (Here on the CPU; on a
    GPU, where reading them would make the CPU wait, data/sft.py checks its batches before they move: test_data.py.)"""
    model = make_model()
    idx = torch.randint(0, 37, (2, 10))
    targets = torch.full_like(idx, -1)
    targets[:, 6:] = 3
    model(idx, targets, t_out=4)  # fine: all targets are in the last 4 positions
    with pytest.raises(ValueError, match="t_out"):
        model(idx, targets, t_out=3)


def test_cache_from_another_model_is_rejected():
    """decode() refuses a cache made by a different model, and a batch that does not match the cache."""
    model, other = make_model(), make_model()
    _, cache = other.prefill(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="cache"):
        model.decode(torch.zeros(2, dtype=torch.long), cache)
    _, cache = model.prefill(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch"):
        model.decode(torch.zeros(3, dtype=torch.long), cache)


def test_bad_config_is_rejected():
    """Unknown attention types and impossible shapes are caught when the config is built."""
    with pytest.raises(ValueError, match="attn"):
        OrthrosConfig(attn="linear")
    with pytest.raises(ValueError, match="n_head"):
        OrthrosConfig(n_embd=10, n_head=3)


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
    """On the GPU in bf16, both fast windows match the float64 reference, forward and backward, with no NaN."""
    torch.manual_seed(T)
    q, k, v = (torch.randn(2, 6, T, 128, device="cuda") for _ in range(3))
    dy = torch.randn(2, 6, T, 128, device="cuda")
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref, window)
    ref_grads = torch.autograd.grad(ref_out, ref, dy.double())
    fast = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    if impl == "flex":
        out = flex_sliding_window_attention(*fast, window)
    else:
        out = blocked_sliding_window_attention(*fast, window)
    grads = torch.autograd.grad(out, fast, dy.bfloat16())
    assert rel_err(out, ref_out) < 1e-2
    for g, g_ref in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert rel_err(g, g_ref) < 2e-2


@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_cuda_bf16_model_matches_float64_and_decodes_consistently(attn, compiled):
    """A bf16 model on the GPU matches its float64 CPU twin, and its prefill + decode matches its own forward."""
    model = make_model(attn, window=128, n_layer=2, n_embd=256, n_head=2, vocab_size=97)
    idx = torch.randint(0, 97, (2, 400))
    ref, _ = model(idx)
    gpu = make_model(attn, window=128, n_layer=2, n_embd=256, n_head=2, vocab_size=97, dtype=torch.bfloat16)
    gpu.load_state_dict(model.state_dict())
    gpu = gpu.cuda()
    if compiled:
        compile_blocks(gpu)
    logits, _ = gpu(idx.cuda())
    assert rel_err(logits, ref) < 2e-2
    inc = incremental_logits(gpu, idx.cuda(), 300)
    assert rel_err(inc, logits[:, 299:]) < 2e-2
    gpu.train()
    _, loss = gpu(idx.cuda(), idx.cuda())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())


# -----------------------------------------------------------------------------
# The optional convolution (not in the paper), whose interface engine.py relies on

def test_causal_depthwise_conv_continues_from_its_state():
    """The convolution of a sequence equals that of two chunks, the second starting from the first's state."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    weight = torch.randn(4, 1, 3, dtype=torch.float64)
    zeros = x.new_zeros(2, 2, 4)
    y, state = causal_depthwise_conv(x, weight, zeros)
    y1, state1 = causal_depthwise_conv(x[:, :5], weight, zeros)
    y2, state2 = causal_depthwise_conv(x[:, 5:], weight, state1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=0, atol=1e-12)
    assert torch.equal(state2, state) and torch.equal(state, x[:, -2:])
    assert make_model(conv_kernel=3).blocks[0].attn.conv.weight.shape == (16, 1, 3)


# -----------------------------------------------------------------------------
# The options of converted pretrained models (grouped-query attention, SwiGLU, an untied head,
# RMSNorm's eps, Llama 3's RoPE scaling, Q/K/V biases): the invariants hold with all of them on

LLAMA = dict(n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=24, tie_embeddings=False, norm_eps=1e-5, qkv_bias=True,
             rope_base=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_llama_options_training_forward_equals_prefill_plus_decode(attn):
    """With every conversion option on, pre-training logits equal prefill + one-token decode steps."""
    model = make_model(attn, **LLAMA)
    idx = torch.randint(0, 37, (3, 3 * 8 + 5))
    full, _ = model(idx)
    for p in [1, 7, 8, 9, 28, 29]:
        torch.testing.assert_close(incremental_logits(model, idx, p), full[:, p - 1:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_llama_options_t_out_gives_the_last_rows(attn):
    """With every conversion option on, forward(t_out=k) is the last k rows of forward(t_out=T)."""
    model = make_model(attn, **LLAMA)
    idx = torch.randint(0, 37, (2, 21))
    full, _ = model(idx)
    for k in (1, 2, 8, 20, 21):
        torch.testing.assert_close(model(idx, t_out=k)[0], full[:, -k:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_llama_options_causality(attn):
    """With every conversion option on, changing token j changes no logits before position j."""
    model = make_model(attn, **LLAMA)
    idx = torch.randint(0, 37, (1, 26))
    logits, _ = model(idx)
    for j in [0, 8, 25]:
        other = idx.clone()
        other[0, j] = (other[0, j] + 1) % 37
        other_logits, _ = model(other)
        torch.testing.assert_close(other_logits[:, :j], logits[:, :j], rtol=0, atol=0)
        assert not torch.equal(other_logits[:, j], logits[:, j])


def test_grouped_query_attention_is_attention_with_shared_kv_heads():
    """n_kv_head = 2 of 4 heads equals full multi-head attention whose K, V heads 2g and 2g+1 are copies of head g."""
    grouped = make_model(**LLAMA)
    full = make_model(**{**LLAMA, "n_kv_head": None})
    state = grouped.state_dict()
    for name, w in state.items():
        if ".c_k." in name or ".c_v." in name:   # (2 * D, ...) -> (4 * D, ...): each head's rows twice, in order
            state[name] = w.unflatten(0, (2, -1)).repeat_interleave(2, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    idx = torch.randint(0, 37, (2, 19))
    torch.testing.assert_close(full(idx)[0], grouped(idx)[0], rtol=0, atol=1e-12)
    _, cache = grouped.prefill(idx)
    assert cache.layers[0].k.shape == cache.layers[0].v.shape == (2, 2, 19, 4)


def test_untied_head_is_a_matrix_of_its_own():
    """tie_embeddings=False gives the LM head its own weight; the default shares the embedding's."""
    tied, untied = make_model(), make_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight and not torch.equal(untied.lm_head.weight, untied.wte.weight)


def test_bad_conversion_options_are_rejected():
    """A KV-head count that does not divide n_head, an unknown MLP, an unknown RoPE scaling: one error each."""
    with pytest.raises(ValueError, match="n_kv_head"):
        OrthrosConfig(n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="mlp"):
        OrthrosConfig(mlp="relu")
    with pytest.raises(ValueError, match="rope_scaling"):
        OrthrosConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling"):
        OrthrosConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0})
