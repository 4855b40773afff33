"""
The fast decoder (perf/engine.py) is the naive KV-cache decoder (Orthros.prefill/decode) with
another cache and one FlexAttention call per layer: the same tokens and the same logits. CPU
tests in float32 (FlexAttention takes no float64), tiny shapes; the tests marked `cuda` replay
the CUDA graph in bf16, on a trained checkpoint and at the bench's 128K keys.

Compiling FlexAttention on a CPU takes seconds (~15 s), so the CPU tests share one compiled kernel:
every Orthros decoder here has the shapes of the fixture `runs` (batch 2, max_len 400: 4 blocks of
128 rows). The Transformer and SWA compile their layers with a backend that counts graphs and runs
them eagerly (FlexAttention's reference path there, which reads no block table: a test of its own
checks the tables; the CUDA tests compile all three).

Run: python -m pytest -q tests/test_engine.py
"""

import pytest
import torch

import orthros
import test_orthros
from orthros import ATTN_TYPES, OrthrosConfig, in_window
from perf import engine
from perf.engine import BLOCK, FastDecoder, block_table

VOCAB, BATCH, MAX_LEN = 61, 2, 400
# (prompt length, decode steps): the longest first, so that later prompts leave stale rows behind.
# They cross the blocks at 384, 128 and 256 keys, and start inside and outside the window (8).
SEGMENTS = [(380, 10), (1, 10), (122, 8), (251, 7)]
CASES = {"orthros": ("orthros", 0, {}), "orthros+conv": ("orthros", 3, {}),
         "transformer": ("transformer", 0, {}), "swa": ("swa", 0, {}),   # and Qwen3's head norms:
         "orthros+qk_norm": ("orthros", 0, {"n_embd": 24, "head_dim": 8, "qk_norm": True})}


def make_model(attn="orthros", conv_kernel=0, dtype=torch.float32, **overrides):
    """test_orthros.py's tiny model (scale-offsets and convolution off identity), in float32 by default."""
    return test_orthros.make_model(attn, dtype=dtype, **{"vocab_size": VOCAB, "max_seq_len": MAX_LEN,
                                                         "conv_kernel": conv_kernel, **overrides})


def unique_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def teacher_forced(model, fast, idx, steps, graphs):
    """Greedy decoding by the naive decoder, and the fast decoder fed the same tokens: (tokens
    (B, steps), naive logits, fast logits (B, steps + 1, vocab), graphs compiled at each step).
    graphs(): how many graphs have been compiled so far."""
    logits, state = model.prefill(idx)
    fast_logits, fast_state = fast.prefill(idx)
    tokens, all_logits, all_fast, compiled = [], [logits], [fast_logits], []
    for _ in range(steps):
        next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)   # (B, 1)
        tokens.append(next_idx)
        logits, state = model.decode(next_idx, state)
        before = graphs()
        fast_logits, fast_state = fast.decode(next_idx, fast_state)
        compiled.append(graphs() - before)
        all_logits.append(logits)
        all_fast.append(fast_logits)
    return torch.cat(tokens, 1), torch.cat(all_logits, 1), torch.cat(all_fast, 1), compiled


@pytest.fixture(scope="module")
def runs():
    """Every case of CASES decoded over SEGMENTS by the naive and the fast decoder, batch 2:
    {case: [(tokens, naive logits, fast logits, graphs compiled per step) per segment]}. Orthros
    compiles FlexAttention (one kernel for both Orthros models); the baselines compile={"backend":
    a graph counter}. Also "decoders": {case: the FastDecoder}."""
    counted = []

    def counting_backend(gm, example_inputs):
        counted.append(gm)
        return gm.forward

    out = {"decoders": {}}
    gen = torch.Generator().manual_seed(1)
    for case, (attn, conv_kernel, options) in CASES.items():
        model = make_model(attn, conv_kernel, **options)
        if attn == "orthros":
            fast, graphs = FastDecoder(model, BATCH, MAX_LEN), unique_graphs
        else:
            fast, graphs = FastDecoder(model, BATCH, MAX_LEN, compile={"backend": counting_backend}), lambda: len(counted)
        out["decoders"][case] = fast
        out[case] = [teacher_forced(model, fast, torch.randint(0, VOCAB, (BATCH, T), generator=gen), steps, graphs)
                     for T, steps in SEGMENTS]
    return out


@pytest.mark.parametrize("case", CASES)
def test_fast_decoder_gives_the_naive_tokens_and_logits(runs, case):
    """Over 35 steps in four segments, crossing key blocks and the window, with stale cache rows
    from longer prompts: the naive decoder's greedy tokens, and its logits within 1e-5 (float32)."""
    for tokens, logits, fast_logits, _ in runs[case]:
        assert torch.equal(fast_logits.argmax(-1)[:, :-1], tokens)
        torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_a_long_generation_compiles_once(runs, case):
    """Every step after a decoder's first reuses its graph: no compiling per step, length or
    block, nor per prompt; the second Orthros model reuses the first one's kernel."""
    compiled = [n for *_, per_step in runs[case] for n in per_step]
    assert sum(compiled[1:]) == 0   # the baselines: layer_in, attention, layer_out, each shared by all layers
    if case.startswith("orthros"):   # the first Orthros compiles FlexAttention; the others reuse it
        assert compiled[0] == (1 if case == "orthros" else 0)
    else:
        assert compiled[0] >= 1


@pytest.mark.parametrize("case", CASES)
def test_generate_tokens_gives_the_models_greedy_tokens(runs, case):
    """FastDecoder.generate_tokens, the step choosing the next token itself: model.generate_tokens's
    greedy tokens, over a prompt that stays inside the window and one that crosses it and a block."""
    fast = runs["decoders"][case]
    gen = torch.Generator().manual_seed(4)
    for T, steps in ((5, 20), (130, 30)):
        idx = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
        mine = torch.cat(list(fast.generate_tokens(idx, steps, temperature=0)), 1)
        assert torch.equal(mine, torch.cat(list(fast.model.generate_tokens(idx, steps, temperature=0)), 1))


def test_compiled_step_is_one_graph_from_token_to_token():
    """compile=True: the whole step is one graph, traced once per sampling rule: the embedding, every
    layer with its FlexAttention call, the head and the choice of the next token (argmax, or the
    exponential race after top-k); it decodes the naive tokens, and nothing is traced after warm_up."""
    graphs = []
    model = make_model("orthros", n_layer=3)
    fast = FastDecoder(model, BATCH, MAX_LEN, compile={"backend": lambda gm, _: graphs.append(gm) or gm.forward})
    fast.warm_up(temperature=0)
    fast.warm_up(temperature=0.7, top_k=5)
    assert len(graphs) == 2
    for gm, sampler in zip(graphs, ({"argmax"}, {"topk", "exponential", "argmax"})):
        ops = [str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
        assert sum("embedding" in op for op in ops) == 1 and sum("flex_attention" in op for op in ops) == 3
        assert all(any(name in op for op in ops) for name in sampler), ops
    idx = torch.randint(0, VOCAB, (BATCH, 20), generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat(list(fast.generate_tokens(idx, 12, temperature=0)), 1),
                       torch.cat(list(model.generate_tokens(idx, 12, temperature=0)), 1))
    list(fast.generate_tokens(idx, 12, temperature=0.7, top_k=5))
    assert len(graphs) == 2


def test_warm_up_leaves_the_decoder_as_it_was(runs):
    """warm_up() runs a step (on CUDA: and captures it) in the middle of a generation: the token, the
    position, the convolution's state and the random generator are as before, and decoding goes on exactly."""
    fast = runs["decoders"]["orthros+conv"]
    idx = torch.randint(0, VOCAB, (BATCH, 40), generator=torch.Generator().manual_seed(6))
    logits, state = fast.model.prefill(idx)
    fast_logits, cache = fast.prefill(idx)
    before = [t.clone() for t in (fast.token, fast.pos, *filter(lambda c: c is not None, cache.conv))]
    rng = torch.get_rng_state()
    fast.warm_up(temperature=0.9, top_k=4)
    after = [fast.token, fast.pos, *filter(lambda c: c is not None, cache.conv)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and torch.equal(rng, torch.get_rng_state())
    for _ in range(3):
        next_idx = logits[:, -1].argmax(-1, keepdim=True)
        logits, state = fast.model.decode(next_idx, state)
        fast_logits, cache = fast.decode(next_idx, cache)
        torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.5, None), (1.0, 3)])
def test_sample_draws_from_the_softmax_of_the_top_k(temperature, top_k):
    """orthros.sample_next, which the fast decoder runs inside its graph (no sync): over 40,000 draws from one
    row of logits, each token's frequency is its probability under softmax(logits / temperature),
    renormalised over the top k (4 standard deviations); tokens outside the top k never come."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    torch.manual_seed(0)
    draws = orthros.sample_next(logits.expand(40000, 1, -1), temperature, top_k)
    p = torch.softmax(logits / temperature, dim=-1)
    if top_k is not None:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
        p = p / p.sum()
    freq = torch.bincount(draws.flatten(), minlength=len(logits)) / len(draws)
    assert draws.shape == (40000, 1) and torch.all((freq - p).abs() <= 4 * (p * (1 - p) / 40000).sqrt() + 1e-9)
    torch.manual_seed(0)   # and it is torch.multinomial's own way to draw one sample: the same seed, the same tokens
    assert torch.equal(draws, torch.multinomial(p.expand(40000, -1), num_samples=1))


@pytest.mark.parametrize("window", [None, 1, 8, 128, 200])
def test_block_table_lists_exactly_the_blocks_in_the_window(window):
    """For every position of 5 blocks, block_table lists, in order, exactly the blocks that hold
    a key in_window allows, and kv_num_blocks counts them."""
    n_blocks = 5
    keys = torch.arange(n_blocks * BLOCK)
    for pos in range(n_blocks * BLOCK):
        num, indices = block_table(torch.tensor([pos]), window, n_blocks)
        blocks = (keys[in_window(pos, keys, window)] // BLOCK).unique().tolist()
        assert indices.shape == (1, 1, 1, n_blocks) and indices.dtype == num.dtype == torch.int32
        assert indices.flatten()[:num.item()].tolist() == blocks, pos


def test_fast_decoder_matches_naive_in_inference_mode(runs):
    """The decoder's buffers stay writable under torch.inference_mode (as bench.py runs it)."""
    fast = runs["decoders"]["orthros"]
    idx = torch.randint(0, VOCAB, (BATCH, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        tokens, logits, fast_logits, _ = teacher_forced(fast.model, fast, idx, 5, unique_graphs)
    torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)


def test_cache_rows_are_whole_blocks():
    """max_len 400 gives a cache of 512 rows (4 blocks) per layer, K and V in (B, H, rows, D)."""
    fast = FastDecoder(make_model(), BATCH, MAX_LEN)
    assert fast.cache.rows == 512 and all(k.shape == v.shape == (BATCH, 2, 512, 8) for k, v in zip(fast.cache.k, fast.cache.v))


def test_bad_input_gives_clear_errors(runs):
    """Wrong batch size, a prompt past max_len, decoding past max_len, a cache from another decoder,
    decode before prefill, a max_len beyond the model's max_seq_len and float64 are refused."""
    fast = runs["decoders"]["orthros"]
    model = fast.model
    new = FastDecoder(model, BATCH, MAX_LEN)
    with pytest.raises(ValueError, match="filled by its prefill\(\): call decoder.prefill"):
        new.decode(torch.zeros(BATCH, 1, dtype=torch.long), new.cache)
    with pytest.raises(ValueError, match="batch_size=2"):
        fast.prefill(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="T <= max_len=400"):
        fast.prefill(torch.zeros(BATCH, MAX_LEN + 1, dtype=torch.long))
    logits, cache = fast.prefill(torch.zeros(BATCH, MAX_LEN - 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 2"):
        fast.decode(torch.zeros(3, 1, dtype=torch.long), cache)
    _, naive_cache = model.prefill(torch.zeros(BATCH, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="the KVCache of idx"):
        fast.prefill(torch.zeros(BATCH, 5, dtype=torch.long), naive=naive_cache)   # a cache of another prompt
    with pytest.raises(ValueError, match="needs this decoder.s cache"):
        fast.decode(torch.zeros(BATCH, 1, dtype=torch.long), naive_cache)
    logits, cache = fast.decode(torch.zeros(BATCH, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="past max_len=400"):
        fast.decode(torch.zeros(BATCH, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_seq_len=400"):
        FastDecoder(model, 1, MAX_LEN + 1)
    with pytest.raises(ValueError, match="float64"):
        FastDecoder(make_model(dtype=torch.float64), 1, 16)


# -----------------------------------------------------------------------------
# GPU: the CUDA graph in bf16. A trained model for greedy tokens (a random model's logits are
# too flat: any rounding difference would flip its argmax), random ones for every attention.

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


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoder_gives_the_naive_greedy_tokens(trained_tiny, compile):
    """bf16 on the GPU, one CUDA graph (and compiled layers), trained tiny Orthros, batch 4, 200
    steps (keys 101 ... 300: three blocks): fed the naive decoder's greedy tokens, the same token
    wherever there is no bf16 near-tie (top two logits within 4 rounding steps: there either
    choice is right), logits within 3%, nothing compiled after the first step; decoding on its
    own, the naive tokens up to the first near-tie."""
    model, idx = trained_tiny
    fast = FastDecoder(model, batch_size=4, max_len=301, compile=compile)
    tokens, logits, forced, compiled = teacher_forced(model, fast, idx, 200, unique_graphs)
    clear = ~bf16_near_tie(logits)
    assert torch.equal(forced.argmax(-1)[clear], logits.argmax(-1)[clear])
    assert relative_error(forced, logits) < 0.03 and sum(compiled[1:]) == 0
    free_tokens, step_logits = [], fast.prefill(idx)[0]   # now the fast decoder's own greedy tokens
    for _ in range(200):
        free_tokens.append(step_logits[:, -1].argmax(-1, keepdim=True))
        step_logits, _ = fast.decode(free_tokens[-1], fast.cache)
    free_tokens = torch.cat(free_tokens, 1)
    for row in range(4):
        differ = (free_tokens[row] != tokens[row]).nonzero()
        if len(differ):
            assert bf16_near_tie(logits[row, differ[0, 0]]), f"row {row} diverged at step {differ[0, 0].item()}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_sampling_draws_anew_each_step_and_repeats_with_the_seed(device):
    """Temperature 1 over a flat distribution (the head zeroed: every token equally likely), 200 tokens:
    the step draws anew each time (on CUDA inside its graph: a draw frozen into the graph would repeat one
    token), so they take most of the 61 values; the same seed gives the same tokens, another seed others."""
    model = make_model(**({"n_embd": 64, "n_head": 2} if device == "cuda" else {})).to(device)  # FlexAttention: D >= 16 on CUDA
    torch.nn.init.zeros_(model.lm_head.weight)
    fast = FastDecoder(model, BATCH, MAX_LEN, compile=device == "cuda")
    idx = torch.zeros(BATCH, 10, dtype=torch.long, device=device)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(torch.cat(list(fast.generate_tokens(idx, 200, temperature=1.0)), 1))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert all(len(row.unique()) > VOCAB // 2 for row in runs[0])


# Every case of CASES, and one with the options for Llama-architecture models: grouped-query
# attention (FlexAttention's enable_gqa: 2 query heads per key/value head) and a SwiGLU MLP.
CUDA_CASES = {**CASES,
              "orthros+gqa+swiglu": ("orthros", 0, {"n_head": 4, "n_kv_head": 2, "mlp": "swiglu"})}


@cuda
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoder_is_as_close_to_float32_as_naive_bf16(case, compile):
    """Every attention, the convolution and grouped-query attention, random weights, bf16, batch 2,
    150 steps from a prompt of 120 (keys 121 ... 270: three blocks): fed the same tokens, the fast
    decoder's logits are as close to the naive decoder's in float32 as the naive decoder's in bf16
    are (about 1%), and nothing is compiled after the first step."""
    attn, conv_kernel, options = CUDA_CASES[case]
    options = {"n_embd": 64, "n_head": 2, "window": 32, **options}
    model = make_model(attn, conv_kernel, **options).cuda()
    bf16 = make_model(attn, conv_kernel, **options).cuda().bfloat16()
    idx = torch.randint(0, VOCAB, (2, 120), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    _, reference, naive_bf16, _ = teacher_forced(model, bf16, idx, 150, unique_graphs)
    _, _, fast, compiled = teacher_forced(model, FastDecoder(bf16, 2, 300, compile=compile), idx, 150, unique_graphs)
    assert relative_error(fast, reference) <= 1.5 * relative_error(naive_bf16, reference) + 1e-3
    assert sum(compiled[1:]) == 0


@cuda
@pytest.mark.parametrize("windows", [(128, None), (None,), (128,)])
def test_cuda_fused_attention_at_128k_keys_in_one_graph(windows):
    """bf16 at the bench's long context: batch 1, 6 heads of 128, a cache of 131,072 rows; one
    captured CUDA graph of the compiled FlexAttention call replayed at positions 130,000 and 700
    (the length in device tensors only): each within 1e-2 of the float64 reference."""
    torch.manual_seed(0)
    S, L = 131072, len(windows)
    q = torch.randn(1, 6, L, 128, device="cuda").bfloat16()
    k = torch.randn(1, 6, S, 128, device="cuda").bfloat16()
    v = torch.randn(1, 6, S, 128, device="cuda").bfloat16()
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    mask, refresh = engine.decode_block_mask(pos, windows, S)

    def step():
        refresh()
        return engine.compiled_flex_attention(q, k, v, block_mask=mask)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    keys = torch.arange(S, device="cuda")
    for p in (130000, 700):
        pos.fill_(p)
        graph.replay()
        allowed = torch.stack([in_window(p, keys, w) for w in windows])              # (L, S)
        scores = (q.double() @ k.double().transpose(-1, -2) / 128 ** 0.5).masked_fill(~allowed, float("-inf"))
        assert relative_error(out, torch.softmax(scores, -1) @ v.double()) < 1e-2, p


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


def test_forward_flops_counts_every_matmul_with_any_head_width():
    """perf/flops.py's count of one token's forward is torch's FlopCounterMode's (the reference
    attention's matmuls), with heads of width 8 where n_embd / n_head is 12, grouped-query
    attention, SwiGLU, an untied head."""
    from torch.utils.flop_counter import FlopCounterMode
    from perf.flops import forward_flops
    for attn in ATTN_TYPES:
        model = make_model(attn, n_embd=24, head_dim=8, n_kv_head=1, mlp="swiglu", mlp_hidden=40,
                           tie_embeddings=False, swa_impl="dense")
        with FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, 1, dtype=torch.long))
        assert counter.get_total_flops() == forward_flops(model.config, 1, 1), attn


def test_bench_tiny_cpu_smoke_runs_every_section(tmp_path, runs):
    """python perf/bench.py --tiny --device cpu for Orthros at the shapes of `runs` (its compiled kernel),
    one length, round and few steps: every section (prefill, decode: naive and fast) records
    its figures without an error, and the decode records tokens/s, the HBM fraction, no compiling
    in the timed steps and the run's metadata."""
    import json
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--models", "orthros", "--n_embd", "16",
                "--window", "8", "--vocab_size", str(VOCAB), "--prefill_lens", "256", "--reps", "1", "--warmup", "1",
                "--decode_ctx", "390", "--decode_batches", str(BATCH), "--decode_reps", "1", "--decode_steps", "2",
                "--decode_cache", "random", "--train_T", "64", "--out", str(out), "--out_png", "", "--out_decode_png", ""])
    saved = json.loads(out.read_text())
    for section in ("prefill", "decode", "train"):
        assert saved[section] and all(r["status"] == "ok" for r in saved[section]), section
    assert {r["variant"] for r in saved["decode"]} == {"naive", "fast"}
    assert all(r["tokens_per_s"] > 0 and r["hbm_fraction"] > 0 and r["compiles_timed"] == 0 for r in saved["decode"])
    assert {"device", "torch", "git_commit", "git_clean", "date_utc"} <= set(saved["meta"])
