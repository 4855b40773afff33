"""
The fast decoder (engine.py) is the naive KV-cache decoder (Orthros.prefill/decode) with
another cache: the same tokens and the same logits. CPU tests in float32 (float64 for split-K),
tiny shapes; the tests marked `cuda` run the captured graphs in bf16 on a trained checkpoint,
and split-K at 128K keys.

Run: python -m pytest -q test_engine.py
"""

import pytest
import torch

from perf import engine
from perf.engine import FastDecoder, attend, bucket_len, chunked_attention, key_masks, split_k_attention
import test_orthros
from orthros import ATTN_TYPES, Orthros, OrthrosConfig

VOCAB = 61


def make_model(attn="orthros", conv_kernel=0, dtype=torch.float32, **overrides):
    """test_orthros.py's tiny model (scale-offsets and convolution off identity), in float32 by default."""
    return test_orthros.make_model(attn, dtype=dtype, **{"vocab_size": VOCAB, "max_seq_len": 400,
                                                         "conv_kernel": conv_kernel, **overrides})


def greedy(decoder, idx, steps):
    """Greedy decoding with any decoder (prefill/decode): the tokens (B, steps) and the logits
    (B, steps + 1, vocab) of the prefill and of every decode step."""
    logits, state = decoder.prefill(idx)
    all_logits, tokens = [logits], []
    for _ in range(steps):
        next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)   # (B, 1)
        tokens.append(next_idx)
        logits, state = decoder.decode(next_idx, state)
        all_logits.append(logits)
    return torch.cat(tokens, dim=1), torch.cat(all_logits, dim=1)


def assert_same_decoding(model, fast, idx, steps):
    tokens, logits = greedy(model, idx, steps)
    fast_tokens, fast_logits = greedy(fast, idx, steps)
    assert torch.equal(fast_tokens, tokens)
    torch.testing.assert_close(fast_logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("conv_kernel", [0, 3])
def test_fast_decoder_matches_naive_over_many_buckets(attn, conv_kernel):
    """300 greedy steps, batch 3: identical tokens, logits within 1e-6 (float32), while the
    step crosses window boundaries and ~100 buckets of two sizes (chunk 2: rows 8, 10, ...,
    then 4 at a time past 256 keys)."""
    model = make_model(attn, conv_kernel)
    idx = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    assert_same_decoding(model, FastDecoder(model, batch_size=3, max_len=307, chunk=2), idx, 300)


@pytest.mark.parametrize("attn", ATTN_TYPES)
def test_fast_decoder_matches_naive_around_window_and_bucket_edges(attn):
    """Prompts one short of, at, and one past the window (8) and a bucket edge (16), each
    decoded 12 steps by one decoder, re-prefilled each time (stale cache rows must not leak)."""
    model = make_model(attn, conv_kernel=3)
    fast = FastDecoder(model, batch_size=2, max_len=40, chunk=16)
    gen = torch.Generator().manual_seed(2)
    for T in [28, 1, 7, 8, 9, 15, 16, 17]:   # the longest first: later prompts leave stale rows behind
        assert_same_decoding(model, fast, torch.randint(0, VOCAB, (2, T), generator=gen), 12)


def test_fast_decoder_matches_naive_in_inference_mode():
    """The decoder's buffers stay writable under torch.inference_mode (as bench.py runs it)."""
    model = make_model()
    fast = FastDecoder(model, batch_size=1, max_len=30)
    idx = torch.randint(0, VOCAB, (1, 5))
    with torch.inference_mode():
        assert_same_decoding(model, fast, idx, 20)
    assert_same_decoding(model, fast, idx, 20)  # and again outside it


def test_fast_decoder_reads_whole_buckets_of_an_aligned_cache(monkeypatch):
    """With an odd max_len (301, chunk 8) the cache is allocated in whole buckets (304 rows), and
    every step's attention reads a whole bucket, a multiple of the chunk,
    never a count clamped to max_len: over ~37 buckets, up to the last step, whose bucket (304)
    is past max_len."""
    read = []
    real = engine.decode_attention

    def spy(q, k_cache, v_cache, masks, window, split):   # the keys each layer's attention reads
        read.append(masks.size(1) * masks.size(2))
        return real(q, k_cache, v_cache, masks, window, split)

    monkeypatch.setattr(engine, "decode_attention", spy)
    model = make_model()
    fast = FastDecoder(model, batch_size=2, max_len=301, chunk=8)
    cache = fast.cache
    assert cache.rows == 304 and bucket_len(301, 8) == 304
    assert all(k.size(2) == 304 for k in cache.k) and all(v.shape[0] * v.shape[3] == 304 for v in cache.v)
    logits, state = fast.prefill(torch.randint(0, VOCAB, (2, 5)))
    seen = []
    while state.length < 301:
        length = state.length
        logits, state = fast.decode(logits[:, -1].argmax(-1), state)
        n = fast.last_n_keys
        assert n % 8 == 0 and length < n <= 304 and n == bucket_len(length + 1, 8)
        assert read[-model.config.n_layer:] == [n] * model.config.n_layer
        seen.append(n)
    assert len(set(seen)) >= 30 and seen[-1] == 304


def test_fast_decoder_at_the_issues_odd_length():
    """max_len = 4,151 (prompt + new tokens, as sample.py and bench.py build it): the cache holds
    4,352 rows (17 x 256) and the steps read 4,096 and then 4,352 keys, not
    4,151; the same logits as the naive decoder."""
    model = make_model(max_seq_len=4200)
    fast = FastDecoder(model, batch_size=1, max_len=4151)
    assert fast.cache.rows == 4352
    idx = torch.randint(0, VOCAB, (1, 4094), generator=torch.Generator().manual_seed(3))
    tokens, logits = greedy(model, idx, 5)
    fast_tokens, fast_logits = greedy(fast, idx, 5)
    assert fast.last_n_keys == 4352 and torch.equal(fast_tokens, tokens)
    torch.testing.assert_close(fast_logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attn", ATTN_TYPES)
@pytest.mark.parametrize("conv_kernel", [0, 3])
def test_split_k_decoder_matches_naive_across_the_threshold(attn, conv_kernel, monkeypatch):
    """float64, batch 3, 130 greedy steps from a prompt of 20: the steps read 24 ... 152 keys in
    chunks of 4, one softmax per row below split_k_from = 64, split-K from there on (SWA reads
    its window instead): the naive decoder's tokens, logits within 1e-6."""
    calls = {"split": 0, "one": 0}
    for name, key in (("split_k_attention", "split"), ("chunked_attention", "one")):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, real=real, key=key: calls.__setitem__(key, calls[key] + 1) or real(*a))
    model = make_model(attn, conv_kernel, dtype=torch.float64)
    fast = FastDecoder(model, batch_size=3, max_len=150, chunk=4, split_k_from=64)
    idx = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    assert_same_decoding(model, fast, idx, 130)
    if attn == "swa":
        assert calls == {"split": 0, "one": 0}
    else:  # 2 layers; the steps at lengths 20 ... 59 read 24 ... 60 keys, those at 60 ... 149 read 64 ... 152
        assert calls == {"one": 2 * 40, "split": 2 * 90}


@pytest.mark.parametrize("conv_kernel", [0, 3])
@pytest.mark.parametrize("split_k_from", [None, 64])
def test_orthros_base_twin_reading_its_window_by_rows_matches_naive(conv_kernel, split_k_from, monkeypatch):
    """float64, batch 3, 130 greedy steps from a prompt of 20 (window 8): both twins in one pass
    below window_rows_from = 48 keys, from there on the base twin reads its window by rows and the
    output twin alone reads the bucket (with and without split-K): the naive decoder's tokens,
    logits within 1e-6."""
    gathered = {"n": 0}
    real = engine.window_rows
    monkeypatch.setattr(engine, "window_rows", lambda *a: gathered.__setitem__("n", gathered["n"] + 1) or real(*a))
    model = make_model("orthros", conv_kernel, dtype=torch.float64)
    fast = FastDecoder(model, batch_size=3, max_len=150, chunk=4, split_k_from=split_k_from, window_rows_from=48)
    idx = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    assert_same_decoding(model, fast, idx, 130)
    assert gathered["n"] == 106   # the steps at lengths 44 ... 149 read 48 ... 152 keys (one call per step)
    assert not fast.uses_window_rows(44) and fast.uses_window_rows(48)


def test_long_context_paths_by_default_follow_the_batch():
    """By default (measured on an H200): split-K at batch 1 from 64K keys, the base twin's window by rows at
    batch >= 8 from 64K keys, neither below 64K keys; explicit values win."""
    model = make_model("orthros")
    one, eight = FastDecoder(model, batch_size=1, max_len=16), FastDecoder(model, batch_size=8, max_len=16)
    assert one.uses_split_k(65536) and not one.uses_split_k(32768) and not one.uses_window_rows(131072)
    assert eight.uses_window_rows(65536) and not eight.uses_window_rows(32768) and not eight.uses_split_k(131072)
    forced = FastDecoder(model, batch_size=8, max_len=16, split_k_from=0, window_rows_from=None)
    assert forced.uses_split_k(256) and not forced.uses_window_rows(131072)
    assert FastDecoder(make_model("swa"), batch_size=1, max_len=16).uses_window_rows(256)   # SWA always does


def random_attention_inputs(L, window, dtype=torch.float64, B=2, H=3, D=16, n=12, c=8, pos=83, scale=3.0, seed=0):
    """q (B, H, L, D), k, v (B, H, n*c, D), v in chunks (n, B, H, c, D), and key_masks' rows
    for the token at pos (the rows past it masked; row 0 windowed for Orthros's base twin)."""
    gen = torch.Generator().manual_seed(seed)
    S = n * c
    q = scale * torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    k = scale * torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    mask = key_masks(torch.tensor([pos]), S, window)[:L]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v, v.unflatten(2, (n, c)).permute(2, 0, 1, 3, 4).contiguous(), mask


@pytest.mark.parametrize("L, window", [(2, 5), (1, None), (1, 5), (2, None)])
def test_split_k_attention_equals_plain_attention(L, window):
    """split_k_attention (and chunked_attention) on random float64 inputs, against attend() and
    the softmax written out: both twins (L=2, row 0 windowed) or one row, masked tail rows (pos
    83 of 96), chunks of 8 with nothing in the window (maxima -inf), scores large enough (scale 3)
    that chunk maxima differ by tens: equal within 1e-12."""
    q, k, v, v_chunks, mask = random_attention_inputs(L, window)
    ref = attend(q, k, v, mask)
    scores = q @ k.transpose(-1, -2) / 4.0 + mask                         # D = 16
    written_out = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(ref, written_out, rtol=0, atol=1e-12)
    for fn in (split_k_attention, chunked_attention):
        torch.testing.assert_close(fn(q, k, v_chunks, mask), ref, rtol=0, atol=1e-12)
    if window:
        assert (mask[0].view(12, 8) == 0).any(-1).sum() <= 2   # most chunks lie outside row 0's window


@pytest.mark.parametrize("L, window", [(2, 5), (1, None)])
def test_split_k_attention_bf16_is_as_close_as_plain(L, window):
    """In bf16 (the CPU path upcasts where cuBLAS would accumulate in float32), split-K is as close
    to the float64 result of the same rounded inputs as the plain attention is (rel. ~1e-3)."""
    q, k, v, v_chunks, mask = random_attention_inputs(L, window, dtype=torch.bfloat16, n=32, c=16, pos=500, scale=1.0)
    ref = attend(q.double(), k.double(), v.double(), mask)
    rel = lambda out: ((out.double() - ref).norm() / ref.norm()).item()
    plain, split = rel(attend(q, k, v, mask)), rel(split_k_attention(q, k, v_chunks, mask))
    assert split < 1e-2 and split <= 1.5 * plain + 1e-3, (split, plain)


def test_compiled_layers_compile_once_per_kind_not_per_step():
    """FastDecoder(compile=...) over the three models in one process, each at batch 1 and 3, and
    then again at batch 1 with another cache size: layer_in and layer_out compile at a decoder's
    first step, once per model kind and batch size; never per step, bucket, split mode, layer,
    model instance or cache size (a counting backend sees every graph torch.compile builds)."""
    torch._dynamo.reset()
    graphs, where = [], [None]

    def backend(gm, example_inputs):
        graphs.append(where[0])
        return gm.forward

    for attn in ATTN_TYPES:
        for B, max_len in ((1, 80), (3, 90), (1, 70)):
            model = make_model(attn, conv_kernel=3 if attn == "orthros" else 0)
            fast = FastDecoder(model, batch_size=B, max_len=max_len, chunk=4, split_k_from=64, compile={"backend": backend})
            logits, state = fast.prefill(torch.randint(0, VOCAB, (B, 40)))
            while state.length < max_len:
                where[0] = (attn, B, state.length)
                logits, state = fast.decode(logits[:, -1].argmax(-1), state)
    # Orthros (two rows, the convolution) and the Transformer (one row, stacked W_QKV) at batch 1
    # and 3: two functions each, at the first step. SWA's layers have the Transformer's shapes
    # and code: in float32 its graphs are reused (in bf16 its attention's output is bf16, the
    # Transformer's float32, and layer_out compiles once more).
    assert graphs == [(attn, B, 40) for attn in ("orthros", "transformer") for B in (1, 3) for _ in range(2)]


def test_bucket_len_rounds_up_by_little():
    """A bucket holds every valid key, reads at most max(chunk, n/64) rows more, never shrinks
    as n grows, and a doubling of n crosses at most 64 buckets."""
    chunk = 256
    buckets = [bucket_len(n, chunk) for n in range(1, 70000)]
    for n, b in enumerate(buckets, start=1):
        assert n <= b <= n + max(chunk, n // 64)
    assert all(a <= b for a, b in zip(buckets, buckets[1:]))
    assert len(set(b for n, b in enumerate(buckets, start=1) if 32768 < n <= 65536)) <= 64


def test_bad_input_gives_clear_errors():
    """Wrong batch size, decoding past max_len, a cache from another decoder, decode before
    prefill, and a max_len beyond the model's max_seq_len are refused with a clear error."""
    model = make_model()
    fast = FastDecoder(model, batch_size=2, max_len=6)
    with pytest.raises(ValueError, match="prefill"):
        fast.decode(torch.zeros(2, 1, dtype=torch.long), fast.cache)
    with pytest.raises(ValueError, match="batch_size=2"):
        fast.prefill(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="does not fit max_len=6"):
        fast.prefill(torch.zeros(2, 7, dtype=torch.long))
    logits, cache = fast.prefill(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 2"):
        fast.decode(torch.zeros(3, 1, dtype=torch.long), cache)
    _, naive_cache = model.prefill(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="not made by this decoder"):
        fast.decode(torch.zeros(2, 1, dtype=torch.long), naive_cache)
    with pytest.raises(ValueError, match="not made by this decoder"):
        FastDecoder(model, batch_size=2, max_len=6).decode(torch.zeros(2, 1, dtype=torch.long), cache)
    for _ in range(2):
        logits, cache = fast.decode(torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="past max_len=6"):
        fast.decode(torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_seq_len=400"):
        FastDecoder(model, batch_size=1, max_len=401)


# -----------------------------------------------------------------------------
# GPU: captured graphs in bf16, on a model trained for a few seconds (a random model's
# logits are too flat: any rounding difference would flip its argmax).

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """A tiny Orthros trained 300 steps on the GPU (seconds), in bf16, and 4 prompts of 100
    tokens from its validation text."""
    import numpy as np
    import train
    from checkpoint import load_checkpoint, model_from_checkpoint
    from data.prepare_utils import DATA_ROOT
    out_dir = tmp_path_factory.mktemp("tiny") / "run"
    train.main(["--config", "tiny", "--device", "cuda", "--max_iters", "300", "--eval_interval", "300",
                "--out_dir", str(out_dir)])
    model = model_from_checkpoint(load_checkpoint(out_dir / "ckpt_last.pt"), max_seq_len=400)
    text = np.memmap(DATA_ROOT / "stdlib" / "val.bin", dtype=np.uint16, mode="r")
    idx = torch.tensor(np.stack([text[i * 1000:i * 1000 + 100] for i in range(4)]).astype(np.int64))
    return model.to("cuda", torch.bfloat16).eval(), idx.cuda()


def bf16_near_tie(logits, ulps=4):
    """Where the top two logits (..., vocab) are within a few bf16 rounding steps of each other,
    so that any other rounding order may pick the other one as the greedy token."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1] <= ulps * torch.finfo(torch.bfloat16).eps * top2[..., 0].abs()


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoder_gives_the_naive_greedy_tokens(trained_tiny, compile):
    """bf16 on the GPU with CUDA graphs (and compiled layers), trained tiny Orthros, batch 4:
    200 greedy tokens equal the naive decoder's up to the first bf16 near-tie (top two logits
    within 4 rounding steps: there either choice is right); fed the naive tokens, the fast
    decoder picks the same token wherever there is no near-tie, with logits within 3%.
    The buckets (128, 192 keys: one softmax per row; 256, 320: split-K) each have their graph."""
    model, idx = trained_tiny
    fast = FastDecoder(model, batch_size=4, max_len=300, compile=compile, chunk=64, split_k_from=256)
    assert fast.cache.rows == 320
    tokens, logits = greedy(model, idx, 200)
    fast_tokens, _ = greedy(fast, idx, 200)
    for row in range(4):
        differ = (fast_tokens[row] != tokens[row]).nonzero()
        if len(differ):
            assert bf16_near_tie(logits[row, differ[0, 0]]), f"row {row} diverged at step {differ[0, 0].item()}"
    # Teacher-forced: the fast decoder decodes the naive decoder's tokens.
    forced, state = fast.prefill(idx)
    forced = [forced]
    for t in range(199):
        step_logits, state = fast.decode(tokens[:, t], state)
        forced.append(step_logits)
    forced = torch.cat(forced, dim=1)                                       # (4, 200, vocab)
    clear = ~bf16_near_tie(logits[:, :200])
    assert torch.equal(forced.argmax(-1)[clear], tokens[clear])
    rel = ((forced.float() - logits[:, :200].float()).norm() / logits[:, :200].float().norm()).item()
    assert rel < 0.03, rel
    assert sorted(fast.graphs) == [128, 192, 256, 320] and fast.uses_split_k(256) and not fast.uses_split_k(192)


@cuda
@pytest.mark.parametrize("L, window", [(2, 128), (1, None)])
def test_cuda_split_k_attention_at_128k_keys(L, window):
    """bf16 on the GPU at the bench's long context: B=1, 6 heads of 128, 131,072 keys in chunks of
    256 (pos 131,000: the last rows masked), Orthros's two twins or the Transformer's one row:
    split-K is as close to float64 as the one-softmax path (relative error ~1e-3), and both are
    well within 1e-2. Also inside a captured CUDA graph: the same result on replay."""
    torch.manual_seed(0)
    S, c, pos = 131072, 256, 131000
    q = torch.randn(1, 6, L, 128, device="cuda").bfloat16()
    k = torch.randn(1, 6, S, 128, device="cuda").bfloat16()
    v = torch.randn(1, 6, S, 128, device="cuda").bfloat16()
    v_chunks = v.unflatten(2, (S // c, c)).permute(2, 0, 1, 3, 4).contiguous()
    mask = key_masks(torch.tensor([pos], device="cuda"), S, window)[:L]
    ref = attend(q.double(), k.double(), v.double(), mask.double())
    rel = lambda out: ((out.double() - ref).norm() / ref.norm()).item()
    split, one = split_k_attention(q, k, v_chunks, mask), chunked_attention(q, k, v_chunks, mask)
    assert rel(split) < 1e-2 and rel(one) < 1e-2 and rel(split) <= 1.5 * rel(one) + 1e-3, (rel(split), rel(one))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split_k_attention(q, k, v_chunks, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = split_k_attention(q, k, v_chunks, mask)
    captured.zero_()
    graph.replay()   # NOTE: cuBLAS may pick another kernel on the capture stream: equal up to rounding
    assert ((captured.float() - split.float()).norm() / split.float().norm()).item() < 1e-2


# -----------------------------------------------------------------------------
# bench.py's decode section drives both decoders through one loop.

def test_decode_bytes_counts_the_prefix_once_and_swa_its_window():
    """A decode step must read every weight once plus the valid KV prefix (Orthros: once for both
    twins, like the Transformer; SWA: only its window)."""
    from perf.bench import decode_bytes
    cfg = {a: OrthrosConfig(attn=a, n_layer=2, n_embd=16, n_head=2, window=8, vocab_size=VOCAB) for a in ATTN_TYPES}
    kv_per_key = 2 * 2 * 16 * 2   # layers x (K, V) x n_embd x bf16 bytes
    assert decode_bytes(cfg["transformer"], 1000, 3, 100) == 1000 * 2 + 3 * 100 * kv_per_key
    assert decode_bytes(cfg["orthros"], 1000, 3, 100) == decode_bytes(cfg["transformer"], 1000, 3, 100)
    assert decode_bytes(cfg["swa"], 1000, 3, 100) == 1000 * 2 + 3 * 8 * kv_per_key
    assert decode_bytes(cfg["swa"], 1000, 3, 5) == 1000 * 2 + 3 * 5 * kv_per_key


def test_bench_decode_section_runs_every_variant(tmp_path):
    """python bench.py --sections decode (tiny, CPU): a median record for every model and variant
    (naive and fast; the fast decoder once per distinct split_k_from: split-K and one softmax,
    SWA's once), with tokens/s, the HBM fraction, no compiling in the timed steps, how the prompt
    cache was made, and the run's metadata in the JSON."""
    import json
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--device", "cpu", "--sections", "decode", "--decode_ctx", "24", "--decode_batches", "2",
                "--decode_reps", "2", "--decode_steps", "3", "--decode_cache", "random", "--out", str(out),
                "--out_decode_png", ""])
    saved = json.loads(out.read_text())
    assert {(r["attn"], r["variant"]) for r in saved["decode"]} == \
        {(a, v) for a in bench.MODELS for v in ("naive", "fast split_k_from=128", "fast split_k_from=none")} - \
        {("swa", "fast split_k_from=none")}
    for r in saved["decode"]:
        assert r["status"] == "ok" and len(r["runs_tokens_per_s"]) == 2 and r["compiles_timed"] == 0
        assert r["tokens_per_s"] > 0 and r["hbm_fraction"] > 0
        if r["decoder"] == "fast":
            assert r["split_k"] == (r["split_k_from"] == 128 and r["attn"] != "swa") and r["keys_read"] == [256]
    assert saved["decode_meta"]["decode_cache"].startswith("random") and not saved["decode_meta"]["skipped"]
    assert {"device", "torch", "git_commit", "git_clean", "date_utc"} <= set(saved["meta"])


def test_bench_decode_time_budget_keeps_the_first_round(tmp_path):
    """A --time_budget that has run out by the end of the first round: every setting keeps its
    first round (which always runs whole), the later ones are listed as skipped."""
    import json
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--device", "cpu", "--sections", "decode", "--decode_ctx", "24", "--decode_batches", "1,2",
                "--decode_reps", "3", "--decode_steps", "2", "--decode_variants", "fast", "--time_budget", "1e-3",
                "--out", str(out), "--out_decode_png", ""])
    saved = json.loads(out.read_text())
    assert saved["decode"] and all(r["runs"] == 1 for r in saved["decode"])
    assert len(saved["decode_meta"]["skipped"]) == 2 * 2   # rounds 2 and 3 of both settings


def test_bench_tiny_cpu_smoke_runs_every_section(tmp_path):
    """python perf/bench.py --tiny --device cpu, cut to one length, round and step: every section
    (prefill, decode, train) records its figures without an error."""
    import json
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--device", "cpu", "--prefill_lens", "256", "--reps", "1", "--warmup", "0", "--decode_ctx", "24",
                "--decode_batches", "1", "--decode_reps", "1", "--decode_steps", "2", "--train_T", "64", "--out", str(out),
                "--out_png", "", "--out_decode_png", ""])
    saved = json.loads(out.read_text())
    for section in ("prefill", "decode", "train"):
        assert saved[section] and all(r["status"] == "ok" for r in saved[section]), section
