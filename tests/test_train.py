"""
Tests for train.py and sample.py (and the checkpoints they write and read): CPU, offline, tiny models.

    python -m pytest -q tests/test_train.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from checkpoint import load_checkpoint, model_from_checkpoint
from checkpoint import save_checkpoint
from data.sft import collate, encode_example
from data.tokenizer import get_tokenizer
from orthros import Orthros, OrthrosConfig

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "tiny", "--device", "cpu", "--eval_iters", "2"]


def run_train(out_dir, *args):
    return train.main([*TINY, "--out_dir", str(out_dir), *args])


def assert_no_step_twice(out_dir):
    """log.jsonl lists each training step once, and each evaluation once."""
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    for kind in ("loss", "val_loss"):
        steps = [r["step"] for r in records if kind in r]
        assert len(steps) == len(set(steps)), (kind, steps)


def snapshot(folder):
    """{file name: bytes} of a folder: to show that a refused run changed nothing in it."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def at_step(monkeypatch, step, action):
    """Make training call action() as it starts step `step` (0-based), through train.lr_at."""
    real_lr_at = train.lr_at
    def lr_at(s, cfg):
        if s == step:
            action()
        return real_lr_at(s, cfg)
    monkeypatch.setattr(train, "lr_at", lr_at)
    return lambda: monkeypatch.setattr(train, "lr_at", real_lr_at)  # undoes it


def simulated_crash():
    raise RuntimeError("simulated crash")  # a hard crash: nothing is saved


def read_log(out_dir):
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    return losses, evals


def test_tiny_config_trains_and_the_loss_falls(tmp_path):
    """A few dozen steps of the tiny config on CPU cut the validation loss clearly."""
    run_train(tmp_path, "--max_iters", "40", "--eval_interval", "20")
    _, evals = read_log(tmp_path)
    assert sorted(evals) == [0, 20, 40]
    assert evals[40] < evals[0] - 1.5  # from ~5.5 (uniform over 257 bytes) to below 4
    ckpt = load_checkpoint(tmp_path / "ckpt_last.pt")
    assert ckpt["step"] == 40 and ckpt["tokenizer"] == "byte" and ckpt["train_config"]["max_iters"] == 40
    assert (tmp_path / "ckpt_best.pt").exists()


def test_resume_continues_with_the_same_losses(tmp_path, monkeypatch):
    """A run that dies after its step-10 checkpoint, resumed, logs the same losses as an uninterrupted run."""
    args = ["--max_iters", "16", "--eval_interval", "10", "--dropout", "0.1"]
    run_train(tmp_path / "whole", *args)
    whole, _ = read_log(tmp_path / "whole")

    undo = at_step(monkeypatch, 13, simulated_crash)
    with pytest.raises(RuntimeError):
        run_train(tmp_path / "broken", *args)
    undo()
    assert load_checkpoint(tmp_path / "broken" / "ckpt_last.pt")["step"] == 10
    run_train(tmp_path / "broken", *args, "--init_from", "resume")
    resumed, _ = read_log(tmp_path / "broken")
    for step in range(11, 17):
        assert resumed[step] == pytest.approx(whole[step], abs=1e-6), step
    assert_no_step_twice(tmp_path / "broken")


def test_killed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies halfway through writing leaves the previous checkpoint loadable and unchanged."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=1, weights=torch.arange(10))
    real_save = torch.save
    def save_half_then_die(obj, f):
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(torch, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, step=2, weights=torch.arange(10) * 2)
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["weights"], torch.arange(10))


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """A non-finite loss stops training with a clear message; the last checkpoint stays good, and the
    message names it, or says that none was written yet."""
    real_forward = Orthros.forward
    calls = {"n": 0, "from": 12}
    def forward_that_breaks(self, idx, targets=None, t_out=None):
        logits, loss = real_forward(self, idx, targets, t_out)
        if self.training:
            calls["n"] += 1
            if calls["n"] > calls["from"] and loss is not None:
                loss = loss * float("nan")
        return logits, loss
    monkeypatch.setattr(Orthros, "forward", forward_that_breaks)
    with pytest.raises(SystemExit):
        run_train(tmp_path / "late", "--max_iters", "30", "--eval_interval", "10")
    ckpt = load_checkpoint(tmp_path / "late" / "ckpt_last.pt")
    assert ckpt["step"] == 10
    assert all(torch.isfinite(w).all() for w in ckpt["model"].values())
    assert "ckpt_last.pt, step 10) is untouched" in capsys.readouterr().err
    calls.update(n=0, **{"from": 2})
    with pytest.raises(SystemExit):
        run_train(tmp_path / "early", "--max_iters", "30", "--eval_interval", "10")
    err = capsys.readouterr().err
    assert "no checkpoint had been written yet" in err and "untouched" not in err
    assert not (tmp_path / "early" / "ckpt_last.pt").exists()


def test_transformer_checkpoint_converts_to_orthros(tmp_path):
    """init_from a transformer checkpoint with attn=orthros and window >= T reproduces the transformer's logits."""
    run_train(tmp_path / "tf", "--attn", "transformer", "--max_iters", "20", "--eval_interval", "20")
    tf_ckpt = tmp_path / "tf" / "ckpt_last.pt"
    # lr 0: the converted model is saved untouched after one step.
    run_train(tmp_path / "conv", "--attn", "orthros", "--window", "128", "--init_from", str(tf_ckpt),
              "--max_iters", "1", "--eval_interval", "1", "--lr", "0")
    transformer = model_from_checkpoint(load_checkpoint(tf_ckpt))
    converted = model_from_checkpoint(load_checkpoint(tmp_path / "conv" / "ckpt_last.pt"))
    assert converted.config.attn == "orthros" and converted.config.window >= 128
    idx = torch.randint(0, 257, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(converted(idx)[0], transformer(idx)[0], rtol=1e-5, atol=1e-5)
    _, tf_evals = read_log(tmp_path / "tf")
    _, conv_evals = read_log(tmp_path / "conv")
    assert conv_evals[0] == pytest.approx(tf_evals[20], abs=1e-4)  # same model, same eval batches


def test_ddp_on_two_cpu_processes_matches_one_process(tmp_path):
    """torchrun with 2 gloo processes gives the same losses as one process on the same global batch."""
    common = [*TINY, "--max_iters", "4", "--eval_interval", "4", "--lr", "1e-2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "train.py", *common, "--batch_size", "4", "--out_dir", str(tmp_path / "ddp")],
                   cwd=REPO, env=env, check=True, capture_output=True)
    run_train(tmp_path / "one", *common[len(TINY):], "--batch_size", "8")
    ddp, _ = read_log(tmp_path / "ddp")
    one, _ = read_log(tmp_path / "one")
    assert sorted(ddp) == [1, 2, 3, 4]
    for step in ddp:
        assert ddp[step] == pytest.approx(one[step], abs=1e-5)


def test_bad_options_are_clear_errors():
    """Unknown configs, unknown keys and badly typed values stop with a message naming them."""
    for argv, words in [(["--config", "huge"], "unknown config"), (["--lrr", "1"], "unknown option --lrr"),
                        (["--lr", "fast"], "--lr takes a float"), (["--compile", "maybe"], "true or false")]:
        with pytest.raises(SystemExit, match=words):
            train.parse_args(argv)
    name, cfg = train.parse_args(["--config", "tiny", "--attn=swa", "--scale_offset", "false"])
    assert (name, cfg.attn, cfg.scale_offset, cfg.n_embd) == ("tiny", "swa", False, 64)


# -----------------------------------------------------------------------------
# sample.py, end to end in a subprocess

def sample(*args):
    return subprocess.run([sys.executable, "sample.py", "--device", "cpu", *args], cwd=REPO,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    run_train(out, "--max_iters", "10", "--eval_interval", "10")
    return out / "ckpt_last.pt"


def test_sample_runs_and_greedy_output_is_deterministic(tiny_ckpt):
    """sample.py generates from a checkpoint, reports speed, and greedy output is the same every run."""
    runs = [sample("--ckpt", str(tiny_ckpt), "--prompt", "def main():", "--temperature", "0",
                   "--max_new_tokens", "30", "--seed", str(seed)) for seed in (1, 2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert "time to first token" in r.stdout and "tokens/s" in r.stdout
    assert runs[0].stdout.split("----------")[1] == runs[1].stdout.split("----------")[1]
    assert "def main():" in runs[0].stdout


def test_sample_decodes_with_the_naive_cache_unless_asked(tiny_ckpt):
    """sample.py runs orthros.py's decoder by default (no tip on CPU); --decoder fast gives the same greedy text."""
    args = ("--ckpt", str(tiny_ckpt), "--prompt", "def main():", "--temperature", "0", "--max_new_tokens", "40", "--no_stop")
    naive, fast = sample(*args), sample(*args, "--decoder", "fast")
    assert naive.returncode == 0 and fast.returncode == 0, naive.stderr + fast.stderr
    assert "naive decoder)" in naive.stdout and "fast decoder)" in fast.stdout and "tip:" not in naive.stdout
    assert naive.stdout.split("----------")[1] == fast.stdout.split("----------")[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sample_suggests_the_fast_decoder(tiny_ckpt):
    """On CUDA, the naive default prints a one-line tip naming --decoder fast; with it, no tip."""
    args = ("--ckpt", str(tiny_ckpt), "--prompt", "x", "--max_new_tokens", "5", "--device", "cuda")
    r = subprocess.run([sys.executable, "sample.py", *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sum(line.startswith("tip:") and "--decoder fast" in line for line in r.stdout.splitlines()) == 1
    r = subprocess.run([sys.executable, "sample.py", *args, "--decoder", "fast"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "tip:" not in r.stdout, r.stderr


def test_sample_finds_the_newest_checkpoint(tiny_ckpt, tmp_path):
    """Without --ckpt, sample.py loads the most recently written checkpoint under --out_dir, in any subfolder."""
    import shutil
    import time
    older, newer = tmp_path / "a" / "ckpt_last.pt", tmp_path / "b" / "deeper" / "ckpt_best.pt"
    for path in (newer, older):  # written in this order: `older` gets the newer mtime...
        path.parent.mkdir(parents=True)
        shutil.copy(tiny_ckpt, path)
    now = time.time()
    os.utime(older, (now - 100, now - 100))  # ...until we make it the older one
    r = sample("--out_dir", str(tmp_path), "--prompt", "x", "--max_new_tokens", "3")
    assert r.returncode == 0, r.stderr
    assert f"loaded {newer} " in r.stdout
    os.utime(newer, (now - 200, now - 200))
    r = sample("--out_dir", str(tmp_path), "--prompt", "x", "--max_new_tokens", "3")
    assert f"loaded {older} " in r.stdout


def test_sample_errors_are_clear(tmp_path, tiny_ckpt):
    """No checkpoint, an empty prompt, a corrupt, truncated or foreign file, an unencodable prompt, bad
    sampling options, a non-UTF-8 prompt file, a missing GPU: one clear line each, no traceback."""
    (tmp_path / "corrupt.pt").write_bytes(b"\x80\x02not a checkpoint")
    (tmp_path / "truncated.pt").write_bytes(tiny_ckpt.read_bytes()[:5000])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    gpt2 = Orthros(OrthrosConfig(vocab_size=50257, n_layer=1, n_head=1, n_embd=8, max_seq_len=64))
    save_checkpoint(tmp_path / "gpt2.pt", model=gpt2.state_dict(), model_config=vars(gpt2.config),
                    tokenizer="gpt2", step=0)
    ckpt = ["--ckpt", str(tiny_ckpt)]
    cases = [(["--out_dir", str(tmp_path / "empty"), "--prompt", "x"], "no checkpoint"),
             ([*ckpt, "--prompt", ""], "prompt is empty"),
             (["--ckpt", str(tmp_path / "corrupt.pt"), "--prompt", "x"], "not a loadable checkpoint"),
             (["--ckpt", str(tmp_path / "truncated.pt"), "--prompt", "x"], "truncated or corrupt (it is not a complete torch zip archive)."),
             (["--ckpt", str(tmp_path / "foreign.pt"), "--prompt", "x"], "not an orthros checkpoint"),
             (["--ckpt", str(tmp_path / "gpt2.pt"), "--prompt", "a <|endoftext|> b"], "<|endoftext|>"),
             ([*ckpt, "--prompt", "x", "--top_k", "0"], "--top_k must be >= 1"),
             ([*ckpt, "--prompt", "x", "--top_k", "-3"], "--top_k must be >= 1"),
             ([*ckpt, "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
             ([*ckpt, "--prompt_file", str(tmp_path / "latin1.txt")], "is not UTF-8 text")]
    if not torch.cuda.is_available():  # a good checkpoint is not called corrupt when the GPU is missing
        cases.append(([*ckpt, "--prompt", "x", "--device", "cuda"], "no usable CUDA GPU"))
    for args, words in cases:
        r = sample(*args)
        assert r.returncode != 0
        assert words in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


@pytest.fixture(scope="module")
def eager_to_end_ckpt(tmp_path_factory):
    """A checkpoint of a byte model whose greedy choice is always the end token."""
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(vocab_size=257, n_layer=1, n_head=1, n_embd=8, max_seq_len=64))
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.zero_()
        direction = torch.randn(8)
        model.wte.weight.copy_(direction + 0.01 * torch.randn(257, 8))
        model.wte.weight[256] = 2 * direction  # the end token's logit is the largest for every input
    path = tmp_path_factory.mktemp("eot") / "ckpt.pt"
    save_checkpoint(path, model=model.state_dict(), model_config=vars(model.config), tokenizer="byte", step=0)
    return path


def test_sample_stops_at_the_end_token_unless_asked_not_to(eager_to_end_ckpt):
    """Generation stops once every sample has produced the end token (not shown); --no_stop goes on."""
    r = sample("--ckpt", str(eager_to_end_ckpt), "--prompt", "abc", "--temperature", "0", "--max_new_tokens", "20",
               "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["new_tokens"] == 1 and result["samples"] == ["abc"] and "<|end|>" not in r.stdout
    r = sample("--ckpt", str(eager_to_end_ckpt), "--prompt", "abc", "--temperature", "0", "--max_new_tokens", "20",
               "--json", "--no_stop")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["new_tokens"] == 20 and result["samples"] == ["abc" + "<|end|>" * 20]


def test_sample_defaults_fit_the_model(tiny_ckpt):
    """With the default --max_new_tokens a tiny model (max_seq_len 128) prints no 'longer than' note; asking
    for more than fits prints it once."""
    r = sample("--ckpt", str(tiny_ckpt), "--prompt", "def fibonacci(n):", "--json")
    assert r.returncode == 0, r.stderr
    assert "longer than" not in r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1])["prompt_tokens"] == 17
    r = sample("--ckpt", str(tiny_ckpt), "--prompt", "def fibonacci(n):", "--max_new_tokens", "300", "--no_stop")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("longer than") == 1


def test_sample_ctrl_c_prints_one_line(tiny_ckpt):
    """sample.py under a real SIGINT while generating stops with one line, no traceback."""
    import signal
    proc = subprocess.Popen([sys.executable, "-u", "sample.py", "--device", "cpu", "--ckpt", str(tiny_ckpt), "--prompt", "x",
                             "--max_new_tokens", "100000", "--no_stop"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("note:")   # the long-generation note, then the load line
    assert proc.stdout.readline().startswith("loaded")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err and err.strip() == "interrupted", err


# -----------------------------------------------------------------------------
# SFT: the T_in / T_out split

def sft_batch():
    tok = get_tokenizer("byte")
    pairs = [("the prompt is long here", "ok"), ("short", "a longer answer"), ("mid prompt", "yes")]
    return collate([dict(zip(("tokens", "mask"), encode_example([p, r], tok))) for p, r in pairs])


@pytest.mark.parametrize("attn", ["orthros", "transformer", "swa"])
def test_sft_loss_with_computed_t_out_equals_full_t_out(attn):
    """The SFT loss with collate's t_out equals the loss with t_out = T and the same mask; prompt
    positions get zero gradient from the loss."""
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(vocab_size=257, n_layer=2, n_head=2, n_embd=16, window=4, attn=attn,
                                  max_seq_len=64)).double()
    x, y, t_out = sft_batch()
    assert t_out < x.size(1)
    _, loss_split = model(x, y, t_out=t_out)
    logits, loss_full = model(x, y, t_out=x.size(1))
    torch.testing.assert_close(loss_split, loss_full, rtol=0, atol=1e-12)
    logits.retain_grad()
    loss_full.backward()
    prompt = y == -1
    assert torch.all(logits.grad[prompt] == 0) and torch.all(logits.grad[~prompt].abs().sum(-1) > 0)


def test_padding_never_leaks_into_an_example():
    """An example's logits in a right-padded batch equal its logits alone."""
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(vocab_size=257, n_layer=2, n_head=2, n_embd=16, window=4, max_seq_len=64)).double()
    x, y, t_out = sft_batch()
    tok = get_tokenizer("byte")
    tokens, _ = encode_example(["short", "a longer answer"], tok)
    alone, _ = model(torch.tensor([tokens[:-1]]))
    batched, _ = model(x)
    torch.testing.assert_close(batched[1, :len(tokens) - 1], alone[0], rtol=0, atol=1e-12)


def test_recall_tiny_orthros_recalls_beyond_the_window_and_swa_does_not(recall_tiny_runs):
    """recall_tiny on CPU: beyond n_layer x window (2 x 32 tokens) Orthros recalls, SWA is near chance."""
    far = {}
    for attn in ("orthros", "swa"):  # trained once per session by conftest.py's recall_tiny_runs
        scores = json.loads((recall_tiny_runs[attn] / "exact_match.json").read_text())
        far[attn] = min(scores[b]["accuracy"] for b in ("64-128", "128-256"))
    # measured 2026-11-29 (2 CPU cores): orthros 1.00 / 0.99 / 1.00 with seeds 1337 / 1 / 2;
    # swa 0.02-0.07 (chance is 1/26 = 0.04)
    assert far["orthros"] >= 0.6
    assert far["swa"] <= 0.3


# -----------------------------------------------------------------------------
# A run never writes over another run's files, and stops cleanly

@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A finished tiny pre-training run: its folder."""
    out = tmp_path_factory.mktemp("pretrained")
    run_train(out, "--max_iters", "10", "--eval_interval", "10")
    return out


def test_sft_from_a_checkpoint_never_writes_into_its_folder(pretrained, tmp_path):
    """The README's SFT command (--init_from a pre-training checkpoint) gets its own default out_dir,
    and writing into the checkpoint's own folder is refused without touching it, even with --overwrite."""
    _, cfg = train.parse_args(["--config", "tiny", "--task", "sft", "--dataset", "data/sft_example"])
    _, pre = train.parse_args(["--config", "tiny"])
    assert cfg.out_dir != pre.out_dir and "sft" in cfg.out_dir
    before = snapshot(pretrained)
    sft = ["--task", "sft", "--dataset", str(REPO / "data" / "sft_example"), "--init_from", str(pretrained / "ckpt_best.pt")]
    for extra in ([], ["--overwrite", "true"]):
        with pytest.raises(SystemExit, match="would write over the run it starts from"):
            run_train(pretrained, *sft, *extra, "--max_iters", "2")
        assert snapshot(pretrained) == before
    run_train(tmp_path / "sft", *sft, "--max_iters", "4", "--eval_interval", "2")
    assert load_checkpoint(tmp_path / "sft" / "ckpt_last.pt")["train_config"]["task"] == "sft"
    assert snapshot(pretrained) == before


def test_an_out_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(pretrained, tmp_path):
    """A new run into a folder that holds a run is refused (nothing changes); --overwrite true replaces it."""
    import shutil
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    before = snapshot(folder)
    with pytest.raises(SystemExit, match="already holds a run.*--init_from resume.*--overwrite true"):
        run_train(folder, "--max_iters", "3")
    assert snapshot(folder) == before
    run_train(folder, "--max_iters", "3", "--eval_interval", "3", "--overwrite", "true")
    assert load_checkpoint(folder / "ckpt_last.pt")["step"] == 3
    losses, _ = read_log(folder)
    assert sorted(losses) == [1, 2, 3]  # the old run's log is gone, not appended to


BAD_STARTS = [
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--max_iters", "-5"], "--max_iters must be >= 0"),
    (["--eval_iters", "0"], "--eval_iters must be >= 1"),
    (["--eval_interval", "0"], "--eval_interval must be >= 1"),
    (["--seq_len", "0"], "--seq_len must be >= 1"),
    (["--batch_size", "x"], "--batch_size takes an integer"),
    (["--dataset", "no/such/folder"], "no such folder"),
    (["--dataset", "nosuchname"], "unknown dataset 'nosuchname'"),
    (["--dataset", str(REPO / "data" / "sft_example")], "add --task sft"),
    (["--init_from", "resume", "--out_dir", "/nonexistent/run"], "no checkpoint at"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no usable CUDA GPU")])


@pytest.mark.parametrize("args,words", BAD_STARTS, ids=[" ".join(a) for a, _ in BAD_STARTS])
def test_a_run_that_fails_at_start_changes_nothing(pretrained, tmp_path, args, words):
    """Bad options stop with one line that names the problem, before anything in out_dir is touched
    (even with --overwrite true, which would delete the old run's files)."""
    import shutil
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    before = snapshot(folder)
    with pytest.raises(SystemExit) as stopped:
        train.main([*TINY, "--out_dir", str(folder), "--overwrite", "true", *args])
    message = str(stopped.value)
    assert words in message and message.startswith("error: ") and "\n" not in message, message
    assert "--ckpt" not in message  # train.py has no such option
    assert snapshot(folder) == before


def test_max_iters_zero_saves_the_initial_model_and_says_so(tmp_path, capsys):
    """--max_iters 0 evaluates and saves the initial model; the closing line says what was written."""
    run_train(tmp_path, "--max_iters", "0")
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 0
    assert not (tmp_path / "ckpt_best.pt").exists()
    assert "no ckpt_best.pt" in capsys.readouterr().out


def test_ctrl_c_saves_ckpt_last_and_resume_is_exact(tmp_path, monkeypatch, capsys):
    """SIGINT before the first eval stops after the current step, saves ckpt_last.pt, prints how to
    resume; the resumed run gives the same losses as an uninterrupted one and lists no step twice."""
    import signal
    args = ["--max_iters", "12", "--eval_interval", "10", "--dropout", "0.1"]
    run_train(tmp_path / "whole", *args)
    whole, _ = read_log(tmp_path / "whole")
    undo = at_step(monkeypatch, 5, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "broken", *args)
    assert stopped.value.code == 130
    assert load_checkpoint(tmp_path / "broken" / "ckpt_last.pt")["step"] == 6  # step 6 finished, then saved
    out = capsys.readouterr().out
    assert "stopped by SIGINT after step 6" in out and "--init_from resume" in out
    undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored
    run_train(tmp_path / "broken", *args, "--init_from", "resume")
    resumed, _ = read_log(tmp_path / "broken")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(7, 13):
        assert resumed[step] == pytest.approx(whole[step], abs=1e-6), step
    assert_no_step_twice(tmp_path / "broken")


def test_ctrl_c_in_a_terminal_prints_one_line_not_a_traceback(tmp_path):
    """train.py under a real SIGINT exits with code 130, no traceback, a checkpoint and the resume command."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-u", "train.py", *TINY, "--out_dir", str(tmp_path), "--max_iters", "100000",
                             "--eval_interval", "100000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and log.read_text().count('"loss"') >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Resume with: python train.py" in out
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] >= 2


@pytest.mark.parametrize("delay", [0.2, 0.5, 1.0])
def test_ctrl_c_while_train_py_starts_prints_one_line(tmp_path, delay):
    """A real SIGINT while train.py is still importing torch (or setting the run up) stops it with one line, no
    traceback, nothing written. At some moments of `import torch` a SystemExit raised by the handler was swallowed
    there and training went on (2026-12-01): the handler exits with os._exit."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-u", "train.py", *TINY, "--out_dir", str(tmp_path / "run")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)  # past Python's start-up (tens of ms), inside `import torch` (over a second) or the set-up
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert err.strip() == "interrupted before training started; nothing was written", err
    assert not (tmp_path / "run").exists()


def test_shape_options_ignored_by_a_checkpoint_are_reported(pretrained, tmp_path, capsys):
    """--init_from CKPT with another --n_embd says that the checkpoint's shape wins."""
    run_train(tmp_path, "--init_from", str(pretrained / "ckpt_last.pt"), "--n_embd", "128", "--max_iters", "1",
              "--eval_interval", "1")
    assert "--n_embd 128 ignored: the checkpoint's shape wins" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["model_config"]["n_embd"] == 64


def test_help_lists_every_option_with_its_description_and_the_configs():
    """train.py --help shows each TrainConfig field with its comment, and what every named config sets."""
    text = train.build_parser().format_help()
    helps = train.field_help()
    assert set(helps) == {f.name for f in train.fields(train.TrainConfig)}
    for name, words in helps.items():
        assert f"--{name}" in text and " ".join(words.split()[:3]) in " ".join(text.split()), name
    for name, preset in train.CONFIGS.items():
        assert name in text and all(f"{k}={v}" in text for k, v in preset.items())


def test_the_first_eval_shows_progress(tmp_path, capsys):
    """Something is printed before the first evaluation finishes: the evaluation's own progress bar."""
    run_train(tmp_path, "--max_iters", "0")
    assert "eval at step 0" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# SFT: the shipped example, buckets, truncation

def test_sft_on_the_shipped_example_reports_accuracy_by_numeric_bucket(pretrained, tmp_path, capsys):
    """data/sft_example (numeric buckets) trains and ends with the exact-match report, buckets in numeric order."""
    run_train(tmp_path, "--task", "sft", "--dataset", str(REPO / "data" / "sft_example"), "--init_from",
              str(pretrained / "ckpt_best.pt"), "--max_iters", "3", "--eval_interval", "3", "--eval_exact_match", "40")
    out = capsys.readouterr().out
    assert "by bucket" in out
    scores = json.loads((tmp_path / "exact_match.json").read_text())
    assert list(scores) == sorted(scores, key=int) and sum(s["n"] for s in scores.values()) == 40


def test_sft_without_buckets_and_with_truncation_reports_cleanly(tmp_path, capsys):
    """Truncating responses longer than seq_len trains and reports without crashing; data without buckets
    gets one accuracy line, not a 'by bucket' table."""
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"prompt": f"say {w}:", "response": w * 3}) for w in ("ab", "cd", "ef", "gh")]
    for split in ("train", "val", "test"):
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    run_train(tmp_path / "run", "--task", "sft", "--dataset", str(data), "--seq_len", "4", "--sft_overlong", "truncate",
              "--max_iters", "5", "--eval_interval", "5")
    out = capsys.readouterr().out
    assert "not scored" in out and "by bucket" not in out
    run_train(tmp_path / "run2", "--task", "sft", "--dataset", str(data), "--max_iters", "2", "--eval_interval", "2")
    out = capsys.readouterr().out
    assert "on test.jsonl: " in out and "by bucket" not in out


def test_a_repeated_sigterm_still_saves(tmp_path, monkeypatch):
    """SIGTERM twice (a supervisor's timeout, then its forwarded copy) still stops after the step and saves."""
    import signal
    def sigterm_twice():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    at_step(monkeypatch, 3, sigterm_twice)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path, "--max_iters", "20", "--eval_interval", "10")
    assert stopped.value.code == 130
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 4
