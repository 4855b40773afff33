"""
The fast decoder (engine.py) is the naive KV-cache decoder (Orthros.prefill/decode) with
another cache: the same tokens and the same logits. CPU tests in float32, tiny shapes; the
test marked `cuda` runs the captured graphs in bf16 on a trained checkpoint.

Run: python -m pytest -q test_engine.py
"""

import pytest
import torch

from perf.engine import FastDecoder, bucket_len
from orthros import ATTN_TYPES, Orthros, OrthrosConfig

VOCAB = 61


def make_model(attn="orthros", conv_kernel=0, dtype=torch.float32, **overrides):
    """A tiny model with its scale-offsets (and convolution) moved off identity, so the twins differ."""
    kw = dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, window=8, attn=attn, max_seq_len=400,
              conv_kernel=conv_kernel)
    kw.update(overrides)
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(**kw)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("alpha", "beta", "alpha_out", "beta_out", "conv"):
                p.add_(0.5 * torch.randn_like(p))
    return model


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
    from sample import load_checkpoint, model_from_checkpoint
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
    decoder picks the same token wherever there is no near-tie, with logits within 3%."""
    model, idx = trained_tiny
    fast = FastDecoder(model, batch_size=4, max_len=300, compile=compile, chunk=64)  # buckets 128, 192, 256, 300
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


def test_bench_decode_section_runs_both_decoders(tmp_path):
    """python bench.py --sections decode (tiny, CPU): a median record for every model and decoder,
    with tokens/s, the HBM fraction, and the run's metadata in the JSON."""
    import json
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--device", "cpu", "--sections", "decode", "--decode_ctx", "24", "--decode_batches", "2",
                "--decode_reps", "2", "--decode_steps", "3", "--out_json", str(out), "--out_png", "", "--out_decode_png", ""])
    saved = json.loads(out.read_text())
    assert {(r["attn"], r["decoder"]) for r in saved["decode"]} == {(a, d) for a in bench.MODELS for d in bench.DECODERS}
    for r in saved["decode"]:
        assert r["status"] == "ok" and len(r["runs_tokens_per_s"]) == 2
        assert r["tokens_per_s"] > 0 and r["hbm_fraction"] > 0
    assert {"device", "torch", "git_commit", "git_clean", "date_utc"} <= set(saved["meta"])
