"""
The fast decoder (perf/engine.py) gives the naive KV-cache decoder's tokens and logits: on CPU in
float32 (the baselines compiled by a backend that counts graphs and runs them eagerly), and, marked
`cuda`, as a CUDA graph in bf16. Then perf/'s FLOP count and the bench.
"""

import json
import weakref

import pytest
import torch

import test_orthros
from orthros import ATTN_TYPES, in_window
from perf import engine
from perf.engine import BLOCK, FastDecoder, block_table
from test_orthros import rel_err

VOCAB, BATCH, MAX_LEN = 61, 2, 400
# (prompt length, decode steps): the longest first, so that later prompts leave stale rows behind.
# They cross the blocks at 384, 128 and 256 keys, and start inside and outside the window (8).
SEGMENTS = [(380, 6), (1, 9), (124, 5), (253, 4)]
CASES = {"orthros": ("orthros", 0, {}), "orthros+conv": ("orthros", 3, {}),
         "transformer": ("transformer", 0, {}), "swa": ("swa", 0, {}),
         "orthros+qk_norm": ("orthros", 0, {"n_embd": 24, "head_dim": 8, "qk_norm": True})}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_model(attn="orthros", conv_kernel=0, dtype=torch.float32, **overrides):
    """test_orthros.py's tiny model (scale-offsets and convolution off identity), in float32."""
    options = {"vocab_size": VOCAB, "max_seq_len": MAX_LEN, "conv_kernel": conv_kernel, **overrides}
    return test_orthros.make_model(attn, dtype=dtype, **options)


def prompt(B, T, seed):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def tokens_of(generate_tokens):   # the (B, 1) tokens of a generation, as (B, steps)
    return torch.cat(list(generate_tokens), 1)


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
    """{case: [teacher_forced(...) per segment of SEGMENTS]}, "decoders": {case: FastDecoder},
    "generated": {case: (its generate_tokens', the model's)}, across the window and a block."""
    counted, out, gen = [], {"decoders": {}, "generated": {}}, torch.Generator().manual_seed(1)
    backend = lambda gm, example_inputs: counted.append(gm) or gm.forward
    for case, (attn, conv_kernel, options) in CASES.items():
        model = make_model(attn, conv_kernel, **options)
        if attn == "orthros":
            fast, graphs = FastDecoder(model, BATCH, MAX_LEN), unique_graphs
        else:
            fast = FastDecoder(model, BATCH, MAX_LEN, compile={"backend": backend})
            graphs = lambda: len(counted)
        out["decoders"][case] = fast
        out[case] = [teacher_forced(model, fast, torch.randint(0, VOCAB, (BATCH, T), generator=gen),
                                    steps, graphs) for T, steps in SEGMENTS]
        idx = prompt(BATCH, 124, 4)
        out["generated"][case] = [tokens_of(decoder.generate_tokens(idx, 8, temperature=0))
                                  for decoder in (fast, model)]
    return out


@pytest.mark.parametrize("case", CASES)
def test_fast_decoder_gives_the_naive_tokens_and_logits(runs, case):
    """Across blocks, the window and stale rows: the naive tokens and logits, compiled once."""
    compiled = []
    for tokens, logits, fast_logits, per_step in runs[case]:
        assert torch.equal(fast_logits.argmax(-1)[:, :-1], tokens)
        torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)
        compiled += per_step
    assert sum(compiled[1:]) == 0 and (compiled[0] > 0) == (not case.startswith("orthros"))
    assert torch.equal(*runs["generated"][case])


def test_compiled_step_is_one_graph_from_token_to_token():
    """compile=True traces one graph per sampling rule, at warm_up, and gives the naive tokens."""
    graphs, model = [], make_model("orthros")
    backend = lambda gm, example_inputs: graphs.append(gm) or gm.forward
    fast = FastDecoder(model, BATCH, MAX_LEN, compile={"backend": backend})
    fast.warm_up(temperature=0)
    fast.warm_up(temperature=0.7, top_k=5)
    assert len(graphs) == 2   # fullgraph=True: a break in the step would be an error
    idx = prompt(BATCH, 20, 5)
    assert torch.equal(tokens_of(fast.generate_tokens(idx, 6, temperature=0)),
                       tokens_of(model.generate_tokens(idx, 6, temperature=0)))
    list(fast.generate_tokens(idx, 6, temperature=0.7, top_k=5))
    assert len(graphs) == 2


def test_warm_up_leaves_the_decoder_as_it_was(runs):
    """warm_up() changes no state of a generation, in torch.inference_mode as bench.py runs it."""
    fast = runs["decoders"]["orthros+conv"]
    with torch.inference_mode():
        logits, state = fast.model.prefill(prompt(BATCH, 40, 6))
        fast_logits, cache = fast.prefill(prompt(BATCH, 40, 6))
        kept = (fast.token, fast.pos, *cache.conv)
        state_of = lambda: [t.clone() for t in (*kept, torch.get_rng_state()) if t is not None]
        before = state_of()
        fast.warm_up(temperature=0.9, top_k=4)
        assert all(torch.equal(a, b) for a, b in zip(before, state_of()))
        for _ in range(3):
            next_idx = logits[:, -1].argmax(-1, keepdim=True)
            logits, state = fast.model.decode(next_idx, state)
            fast_logits, cache = fast.decode(next_idx, cache)
            torch.testing.assert_close(fast_logits, logits, rtol=1e-5, atol=1e-5)


def test_block_table_lists_exactly_the_blocks_in_the_window():
    """block_table lists, in order, exactly the blocks holding a key in_window allows."""
    keys = torch.arange(5 * BLOCK)
    for window in (None, 1, 8, 128, 200):
        for pos in range(5 * BLOCK):
            num, indices = block_table(torch.tensor([pos]), window, 5)
            blocks = (keys[in_window(pos, keys, window)] // BLOCK).unique().tolist()
            assert indices.flatten()[:num.item()].tolist() == blocks, (window, pos)


def test_a_dropped_decoder_frees_its_cache_at_once():
    """Nothing holds an eager decoder in a reference cycle: dropped, it frees its cache at once."""
    fast = FastDecoder(make_model(), BATCH, 64)
    list(fast.generate_tokens(torch.zeros(BATCH, 5, dtype=torch.long), 3, temperature=0))
    cache = weakref.ref(fast.cache.k[0])
    del fast
    assert cache() is None


Z = lambda *shape: torch.zeros(*shape, dtype=torch.long)
cache_of = lambda f, T: f.prefill(Z(2, T))[1]        # the decoder's cache after a prompt of T
naive = lambda f: f.model.prefill(Z(2, 4))[1]         # the model's own cache of a prompt of 4
step = lambda f, cache: f.decode(Z(2, 1), cache)[1]
BAD = {  # each call on a decoder of batch 2 and max_len 400, and what its error says
    "decode first": (lambda f: step(f, f.cache), r"filled by its prefill\(\): call decoder"),
    "batch 3": (lambda f: f.prefill(Z(3, 4)), "batch_size=2"),
    "a long prompt": (lambda f: f.prefill(Z(2, 401)), "T <= max_len=400"),
    "decode batch 3": (lambda f: f.decode(Z(3, 1), cache_of(f, 4)), "batch size 2"),
    "another prompt's": (lambda f: f.prefill(Z(2, 5), naive=naive(f)), "KVCache of idx"),
    "a naive cache": (lambda f: step(f, naive(f)), "needs this decoder.s cache"),
    "decode past max_len": (lambda f: step(f, step(f, cache_of(f, 399))), "past max_len=400"),
    "max_len > max_seq_len": (lambda f: FastDecoder(f.model, 1, 401), "max_seq_len=400"),
    "float64": (lambda f: FastDecoder(make_model(dtype=torch.float64), 1, 16), "float64"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_naming_it(case):
    """Each bad input is refused with a one-line ValueError that names what is wrong."""
    call, words = BAD[case]
    with pytest.raises(ValueError, match=words) as e:
        call(FastDecoder(make_model(), BATCH, MAX_LEN))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_sampling_draws_anew_each_step_and_repeats_with_the_seed(device):
    """The step draws anew each time (on CUDA, in its graph), the same for the same seed."""
    model = make_model(**({"n_embd": 64} if device == "cuda" else {})).to(device)  # CUDA: D >= 16
    torch.nn.init.zeros_(model.lm_head.weight)   # every token equally likely
    fast = FastDecoder(model, BATCH, MAX_LEN, compile=device == "cuda")
    idx = torch.zeros(BATCH, 10, dtype=torch.long, device=device)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(tokens_of(fast.generate_tokens(idx, 60, temperature=1.0)))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert all(len(row.unique()) > VOCAB // 2 for row in runs[0])   # a frozen draw repeats one


# -----------------------------------------------------------------------------
# GPU: the CUDA graph in bf16. A trained model for greedy tokens (a random model's logits are
# too flat: any rounding difference would flip its argmax), random ones for every attention.

@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """A tiny Orthros trained 300 steps on the GPU (seconds), in bf16, and 4 prompts of 100
    tokens from its validation text."""
    import numpy as np
    import train
    from checkpoint import load_checkpoint, model_from_checkpoint
    from data.prepare_utils import DATA_ROOT
    out_dir = tmp_path_factory.mktemp("tiny") / "run"
    train.main(["--config", "tiny", "--device", "cuda", "--max_iters", "300", "--eval_interval",
                "300", "--out_dir", str(out_dir)])
    model = model_from_checkpoint(load_checkpoint(out_dir / "ckpt_last.pt"), max_seq_len=400)
    text = np.memmap(DATA_ROOT / "stdlib" / "val.bin", dtype=np.uint16, mode="r")
    idx = torch.tensor(np.stack([text[i * 1000:i * 1000 + 100] for i in range(4)]).astype(np.int64))
    return model.to("cuda", torch.bfloat16).eval(), idx.cuda()


def bf16_near_tie(logits, ulps=4):
    """Where the top two logits (..., vocab) are within a few bf16 rounding steps of each other,
    so that any other rounding order may pick the other one as the greedy token."""
    top2 = logits.float().topk(2, dim=-1).values
    eps = torch.finfo(torch.bfloat16).eps
    return top2[..., 0] - top2[..., 1] <= ulps * eps * top2[..., 0].abs()


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoder_gives_the_naive_greedy_tokens(trained_tiny, compile):
    """On a trained model in bf16 the CUDA graph decoder gives the naive tokens but at near-ties."""
    model, idx = trained_tiny
    fast = FastDecoder(model, batch_size=4, max_len=301, compile=compile)
    tokens, logits, forced, compiled = teacher_forced(model, fast, idx, 200, unique_graphs)
    clear = ~bf16_near_tie(logits)
    assert torch.equal(forced.argmax(-1)[clear], logits.argmax(-1)[clear])
    assert rel_err(forced, logits) < 0.03 and sum(compiled[1:]) == 0
    free_tokens, step_logits = [], fast.prefill(idx)[0]   # now the fast decoder's own greedy tokens
    for _ in range(200):
        free_tokens.append(step_logits[:, -1].argmax(-1, keepdim=True))
        step_logits, _ = fast.decode(free_tokens[-1], fast.cache)
    free_tokens = torch.cat(free_tokens, 1)
    for row in range(4):
        differ = (free_tokens[row] != tokens[row]).nonzero()
        if len(differ):
            assert bf16_near_tie(logits[row, differ[0, 0]]), f"row {row} diverged at {differ[0, 0]}"


# Every case of CASES, and one with the options for Llama-architecture models: grouped-query
# attention (FlexAttention's enable_gqa: 2 query heads per key/value head) and a SwiGLU MLP.
CUDA_CASES = {**CASES,
              "orthros+qk_norm": ("orthros", 0, {"n_embd": 24, "head_dim": 32, "qk_norm": True}),
              "orthros+gqa+swiglu": ("orthros", 0, {"n_head": 4, "n_kv_head": 2, "mlp": "swiglu"})}


@cuda
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoder_is_as_close_to_float32_as_naive_bf16(case, compile):
    """In bf16 the CUDA graph decoder is as close to float32 as the naive decoder is."""
    attn, conv_kernel, options = CUDA_CASES[case]
    options = {"n_embd": 64, "n_head": 2, "window": 32, **options}
    model = make_model(attn, conv_kernel, **options).cuda()
    bf16 = make_model(attn, conv_kernel, **options).cuda().bfloat16()
    idx = prompt(2, 120, 3).cuda()
    _, reference, naive_bf16, _ = teacher_forced(model, bf16, idx, 150, unique_graphs)
    fast = FastDecoder(bf16, 2, 300, compile=compile)
    _, _, fast_logits, compiled = teacher_forced(model, fast, idx, 150, unique_graphs)
    naive_error = rel_err(naive_bf16, reference)
    assert rel_err(fast_logits, reference) <= 1.5 * naive_error + 1e-3
    assert sum(compiled[1:]) == 0


@cuda
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_fused_attention_at_128k_keys_in_one_graph(window):
    """One CUDA graph of the FlexAttention step is exact at any position of 128K keys."""
    torch.manual_seed(0)
    S = 131072
    q, k, v = (torch.randn(1, 6, n, 128, device="cuda").bfloat16() for n in (1, S, S))
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    mask, refresh = engine.decode_block_mask(pos, window, S)
    flex = torch.compile(engine.flex_attention, fullgraph=True, dynamic=False)

    def step():
        refresh()
        return flex(q, k, v, block_mask=mask)

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
        allowed = in_window(p, keys, window)                                         # (S,)
        scores = q.double() @ k.double().transpose(-1, -2) / 128 ** 0.5
        scores = scores.masked_fill(~allowed, -torch.inf)
        assert rel_err(out, torch.softmax(scores, -1) @ v.double()) < 1e-2, p


# -----------------------------------------------------------------------------
# perf/: the FLOP count, and the bench's CPU smoke run

def test_forward_flops_counts_every_matmul_with_any_head_width():
    """perf/flops.py counts a forward's FLOPs as FlopCounterMode does, with every option."""
    from torch.utils.flop_counter import FlopCounterMode
    from perf.flops import forward_flops
    for attn in ATTN_TYPES:
        model = make_model(attn, n_embd=24, head_dim=8, n_kv_head=1, mlp="swiglu", mlp_hidden=40,
                           tie_embeddings=False, swa_impl="dense")
        with FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, 1, dtype=torch.long))
        assert counter.get_total_flops() == forward_flops(model.config, 1, 1), attn


def test_bench_tiny_cpu_smoke_runs_every_section(tmp_path):
    """perf/bench.py --tiny on the CPU records every section, with its metadata."""
    from perf import bench
    out = tmp_path / "bench.json"
    bench.main(f"--tiny --device cpu --dtype float32 --models orthros --n_embd 16 --window 8 "
               f"--vocab_size {VOCAB} --prefill_lens 256 --reps 1 --warmup 1 --decode_ctx 390 "
               f"--decode_batches {BATCH} --decode_reps 1 --decode_steps 2 --decode_cache random "
               f"--train_T 64 --out {out} --out_png= --out_decode_png=".split())
    saved = json.loads(out.read_text())
    for section in ("prefill", "decode", "train"):
        assert saved[section] and all(r["status"] == "ok" for r in saved[section]), section
    assert {r["variant"] for r in saved["decode"]} == {"naive", "fast"}
    assert all(r["tokens_per_s"] > 0 and r["hbm_fraction"] > 0 and r["compiles_timed"] == 0
               for r in saved["decode"])
    assert {"device", "torch", "git_commit", "git_clean", "date_utc"} <= set(saved["meta"])
