"""train.py and sample.py, and the checkpoints they write and read: CPU, offline, tiny models."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import sample
import train
from checkpoint import load_checkpoint, model_from_checkpoint, resume_command, save_checkpoint
from data.prepare_utils import PretrainBatches
from data.sft import collate, encode_example
from data.tokenizer import get_tokenizer
from orthros import Orthros, OrthrosConfig
from perf.flops import forward_flops

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "tiny", "--device", "cpu", "--eval_iters", "2"]


def run_train(out_dir, *args):
    return train.main([*TINY, "--out_dir", str(out_dir), *args])


def read_log(out_dir):
    """{step: loss}, {step: val loss} of a run's log.jsonl; each step and evaluation logged once."""
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    for kind in ("loss", "val_loss"):
        steps = [r["step"] for r in records if kind in r]
        assert len(steps) == len(set(steps)), (kind, steps)
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["val_loss"] for r in records if "val_loss" in r})


def snapshot(folder):
    """{file name: bytes} of a folder: to show that a refused run changed nothing in it."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A finished tiny pre-training run of 20 steps: its folder (checkpoints, log.jsonl)."""
    out = tmp_path_factory.mktemp("pretrained")
    run_train(out, "--max_iters", "20", "--eval_interval", "20")
    return out


# -----------------------------------------------------------------------------
# Training, checkpoints, resuming

def test_tiny_config_trains_and_the_loss_falls(pretrained):
    """Twenty steps of the tiny config on CPU cut the validation loss clearly."""
    _, evals = read_log(pretrained)
    assert sorted(evals) == [0, 20] and evals[20] < evals[0] - 1.0   # from ~5.5, uniform over 257
    ckpt = load_checkpoint(pretrained / "ckpt_last.pt")
    assert (ckpt["step"], ckpt["tokenizer"], ckpt["train_config"]["max_iters"]) == (20, "byte", 20)


def test_a_stop_request_saves_and_resuming_gives_the_same_losses(tmp_path, monkeypatch, capsys):
    """SIGTERM, even twice, stops after the step, saves, prints the resume; resumed, same losses."""
    args = ["--max_iters", "8", "--eval_interval", "8", "--dropout", "0.1"]
    run_train(tmp_path / "whole", *args)
    whole, _ = read_log(tmp_path / "whole")
    real_lr_at = train.lr_at
    def lr_at(step, cfg):   # as step 3 (0-based) starts
        for _ in range(2 if step == 3 else 0):
            signal.raise_signal(signal.SIGTERM)
        return real_lr_at(step, cfg)
    monkeypatch.setattr(train, "lr_at", lr_at)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "broken", *args)
    assert stopped.value.code == 130
    assert load_checkpoint(tmp_path / "broken" / "ckpt_last.pt")["step"] == 4  # done, then saved
    assert "--init_from resume" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.undo()
    run_train(tmp_path / "broken", *args, "--init_from", "resume")
    resumed, _ = read_log(tmp_path / "broken")
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[s] for s in range(5, 9)] == pytest.approx([whole[s] for s in (5, 6, 7, 8)])


def test_epoch_order_takes_the_next_windows_and_keep_steps_keeps_weights(tmp_path, monkeypatch):
    """--data_order epoch: each micro-step takes the next windows; --keep_steps saves weights."""
    firsts, real_get = [], PretrainBatches.get

    def get(self, split, size, generator, first=None):
        if first is not None:
            firsts.append(first)
        return real_get(self, split, size, generator, first)
    monkeypatch.setattr(PretrainBatches, "get", get)
    run_train(tmp_path, "--max_iters", "3", "--eval_interval", "3", "--batch_size", "4",
              "--grad_accum", "2", "--data_order", "epoch", "--keep_steps", "2,3")
    assert firsts == [0, 4, 8, 12, 16, 20]
    last, kept = load_checkpoint(tmp_path / "ckpt_last.pt"), load_checkpoint(tmp_path / "ckpt_3.pt")
    assert kept["step"] == 3 and "optimizer" not in kept
    assert kept["model"].keys() == last["model"].keys()
    assert all(torch.equal(kept["model"][k], v) for k, v in last["model"].items())
    two = load_checkpoint(tmp_path / "ckpt_2.pt")["model"]
    assert not torch.equal(two["wte.weight"], last["model"]["wte.weight"])
    assert model_from_checkpoint(kept).config.attn == "orthros"


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("CUDA error: illegal\nTORCH")])
def test_ctrl_c_or_a_torch_error_at_setup_propagates_writing_nothing(tmp_path, monkeypatch, error):
    """Ctrl-C, or torch's error (a CUDA failure), while a run is set up propagates as raised."""
    def broken(*args, **kwargs):
        raise error
    monkeypatch.setattr(train, "build_model", broken)
    with pytest.raises(type(error)) as raised:
        run_train(tmp_path / "run")
    assert raised.value is error and not (tmp_path / "run").exists()


def test_killed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies halfway leaves the previous checkpoint loadable and unchanged."""
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


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    """A non-finite loss stops training at the next read, naming its step and the last good save."""
    real_forward = Orthros.forward
    calls = {"n": 0, "from": 7}
    def forward_that_breaks(self, idx, targets=None, t_out=None):
        logits, loss = real_forward(self, idx, targets, t_out)
        calls["n"] += self.training
        return logits, loss * float("nan") if self.training and calls["n"] > calls["from"] else loss
    monkeypatch.setattr(Orthros, "forward", forward_that_breaks)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "late", "--max_iters", "12", "--eval_interval", "5")  # nan 8, read 10
    ckpt = load_checkpoint(tmp_path / "late" / "ckpt_last.pt")
    assert ckpt["step"] == 5
    assert all(torch.isfinite(w).all() for w in ckpt["model"].values())
    message = str(stopped.value)
    assert "loss is nan at step 8 (read at step 10" in message
    assert "ckpt_last.pt, step 5) is untouched" in message
    calls.update(n=0, **{"from": 2})
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "early", "--max_iters", "5", "--eval_interval", "5")  # read at 5
    message = str(stopped.value)
    assert "at step 3 (read at step 5" in message and "no checkpoint had been written" in message
    assert not (tmp_path / "early" / "ckpt_last.pt").exists()


def test_orthros_recalls_beyond_the_window_and_swa_does_not(recall_runs):
    """recall_micro (one layer, w = 16): inside the window SWA recalls, beyond it only Orthros."""
    # One sliding-window layer reaches the value of a pair at most w tokens back (distance <= w,
    # the value w - 1 keys back); Orthros's output tokens attend to every key.
    scores = lambda attn: json.loads((recall_runs[attn] / "exact_match.json").read_text()).items()
    swa, orthros = ({b: (r["n"], r["accuracy"]) for b, r in scores(a)} for a in ("swa", "orthros"))
    config = load_checkpoint(recall_runs["swa"] / "ckpt_last.pt")["model_config"]
    meta = json.loads((REPO / "data" / "recall_micro" / "meta.json").read_text())
    reach, chance = config["n_layer"] * config["window"], 1 / meta["params"]["n_values"]

    def pooled(scores, keep):  # the accuracy over the examples of the buckets that keep(lo, hi)
        chosen = [scores[b] for b in scores if keep(*map(int, b.split("-")))]
        assert chosen, (scores, reach)
        return sum(n * acc for n, acc in chosen) / sum(n for n, _ in chosen)

    assert pooled(swa, lambda lo, hi: hi <= config["window"]) >= 0.9, swa
    assert pooled(swa, lambda lo, hi: lo > reach) <= chance + 0.1, swa
    assert pooled(orthros, lambda lo, hi: lo > reach) >= 0.9, orthros


def test_a_run_from_a_checkpoint_has_its_shape_and_its_start_is_a_best(pretrained, tmp_path):
    """From a checkpoint, a run has its shape (not the preset's) and saves its start as a best."""
    train.main(["--config", "small", "--device", "cpu", "--init_from", f"{pretrained}/ckpt_last.pt",
                "--n_embd", "128", "--seq_len", "64", "--batch_size", "2", "--max_iters", "2",
                "--lr", "0", "--eval_interval", "1", "--eval_iters", "1", "--out_dir",
                str(tmp_path)])
    ckpt = load_checkpoint(tmp_path / "ckpt_last.pt")
    assert ckpt["model_config"]["n_embd"] == ckpt["train_config"]["n_embd"] == 64
    assert ckpt["train_config"]["n_layer"] == 2   # small's is 6
    _, evals = read_log(tmp_path)
    best = load_checkpoint(tmp_path / "ckpt_best.pt")
    assert best["step"] == 0 and best["best_val_loss"] == evals[0] == evals[2]


def test_an_out_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(pretrained, tmp_path):
    """A new run into a run's folder is refused, unchanged; resuming it finished touches no file,
    resumed without improving it keeps ckpt_best.pt; --overwrite true replaces it."""
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    before = snapshot(folder)
    with pytest.raises(SystemExit, match="holds a run.*--init_from resume.*--overwrite true"):
        run_train(folder, "--max_iters", "3")
    assert snapshot(folder) == before
    untouched = lambda: {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}
    before = untouched()
    run_train(folder, "--init_from", "resume", "--max_iters", "20")
    assert untouched() == before   # not even ckpt_last.pt rewritten with the same bytes
    run_train(folder, "--init_from", "resume", "--lr", "0", "--max_iters", "21", "--eval_interval",
              "21")
    assert load_checkpoint(folder / "ckpt_best.pt")["step"] == 20
    run_train(folder, "--max_iters", "3", "--eval_interval", "3", "--overwrite", "true")
    assert load_checkpoint(folder / "ckpt_last.pt")["step"] == 3
    losses, _ = read_log(folder)
    assert sorted(losses) == [1, 2, 3]  # the old run's log is gone, not appended to


def test_resume_restores_the_runs_options_but_the_given_ones_and_its_command_reads_back(tmp_path):
    """Resumed, a run takes its saved options but those given; its command reads back."""
    saved = {**vars(train.TrainConfig(**train.CONFIGS["tiny"])), "lr": 1e-4, "max_iters": 200}
    save_checkpoint(tmp_path / "ckpt_last.pt", step=200, config_name="tiny", train_config=saved)
    name, cfg = train.parse_args(["--config", "tiny", "--init_from", "resume", "--out_dir",
                                  str(tmp_path), "--max_iters", "400", "--warmup_iters", "10"])
    assert (name, cfg.lr, cfg.max_iters, cfg.init_from) == ("tiny", 1e-4, 400, "resume")
    argv = ["--config", "tiny", "--curriculum", "", "--dataset", "my data", "--init_from",
            "old run/ckpt.pt", "--overwrite=true", "--out_dir", str(tmp_path)]
    words = shlex.split(resume_command(argv))
    assert words == ["python", "train.py", "--config", "tiny", "--curriculum", "", "--dataset",
                     "my data", "--out_dir", str(tmp_path), "--init_from", "resume"]
    _, cfg = train.parse_args(words[2:])
    assert (cfg.curriculum, cfg.dataset, cfg.init_from, cfg.lr) == ("", "my data", "resume", 1e-4)
    _, cfg = train.parse_args(["--config", "tiny", "--attn=swa", "--scale_offset", "false"])
    assert (cfg.attn, cfg.scale_offset, cfg.n_embd) == ("swa", False, 64)


# -----------------------------------------------------------------------------
# What a run prints and logs

def test_an_eval_is_not_counted_in_the_next_steps_speed(tmp_path, monkeypatch):
    """ms/step, tokens/s and MFU are measured over the steps between reads, evaluations excluded."""
    # A clock gives every step 1 s and every evaluation 100 s; the peak is 1 TFLOP/s, as if a GPU.
    clock = {"now": 0.0}
    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(train, "peak_flops", lambda device: 1e12)
    for name, seconds in (("train_step", 1.0), ("evaluate", 100.0)):
        def timed(*args, real=getattr(train.Run, name), seconds=seconds):
            clock["now"] += seconds
            return real(*args)
        monkeypatch.setattr(train.Run, name, timed)
    run_train(tmp_path, "--max_iters", "6", "--eval_interval", "3", "--log_interval", "2",
              "--batch_size", "4", "--seq_len", "32")   # reads at 2, 3, 4, 6
    steps = [r for r in map(json.loads, open(tmp_path / "log.jsonl")) if "ms_per_step" in r]
    assert [r["step"] for r in steps] == [2, 3, 4, 6]
    assert [(r["ms_per_step"], r["tok_per_s"]) for r in steps] == [(1000.0, 4 * 32)] * 4
    config = OrthrosConfig(**load_checkpoint(tmp_path / "ckpt_last.pt")["model_config"])
    mfu = 3 * 4 * forward_flops(config, 32, 32) / 1e12   # forward + backward of 4 sequences
    assert [r["mfu"] for r in steps] == pytest.approx([mfu] * 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_cuda_steps_log_their_mfu_and_memory(tmp_path, task):
    """Pre-training and SFT run on a GPU (a NaN would stop them); each read logs MFU and memory."""
    sft = ["--task", "sft", "--dataset", str(REPO / "data" / "sft_example")] * (task == "sft")
    run_train(tmp_path, "--device", "cuda", *sft, "--max_iters", "6", "--eval_interval", "6",
              "--log_interval", "2")
    steps = [r for r in map(json.loads, open(tmp_path / "log.jsonl")) if "ms_per_step" in r]
    assert len(steps) == 3 and all(0 < r["mfu"] < 1 and r["max_memory_gb"] > 0 for r in steps)


def interrupted(args, started):
    """python -u *args, sent SIGINT once a line it prints starts with `started`: code, out, err."""
    proc, head = subprocess.Popen([sys.executable, "-u", *args], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True), []
    for line in proc.stdout:
        head.append(line)
        if line.startswith(started):
            break
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()   # a hang fails the test and leaves no process behind
    return proc.returncode, "".join(head) + out, err


def test_ctrl_c_in_a_real_process_saves_and_prints_how_to_resume(tmp_path):
    """A real SIGINT: 130, saved, how to resume; into a pipe, a line per log_interval and no bar."""
    code, out, err = interrupted(["train.py", *TINY, "--out_dir", str(tmp_path), "--max_iters",
                                  "100000", "--eval_interval", "100000", "--log_interval", "2"],
                                 "step 4:")
    assert code == 130, err
    assert "Traceback" not in err and "Resume with: python train.py" in out
    step = load_checkpoint(tmp_path / "ckpt_last.pt")["step"]
    logged = [line.split(":")[0] for line in out.splitlines() if "tok/s" in line]
    assert "\r" not in out + err and logged == [f"step {s}" for s in range(2, step + 1, 2)], out


# -----------------------------------------------------------------------------
# Bad input: one line, and nothing touched

BAD_STARTS = [
    (["--config", "huge"], "--config invalid choice: 'huge'"), (["--lr", "x"], "takes a float"),
    (["--lrr", "1"], "unknown option --lrr"), (["--compile", "maybe"], "true or false"),
    (["--task", "rl"], "--task"), (["--beta2", "1"], "--beta2 must be in [0, 1)"),
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--max_iters", "-5"], "--max_iters must be >= 0"),
    (["--eval_iters", "0"], "--eval_iters must be >= 1"),
    (["--seq_len", "0"], "--seq_len must be >= 1"),
    (["--n_head", "3"], "must split into n_head=3 heads"),
    (["--window", "0"], "window must be >= 1"),
    (["--attn", "linear"], "unknown attn 'linear'"),
    (["--dataset", "no/such/folder"], "no such folder"),
    (["--dataset", "nosuchname"], "unknown dataset 'nosuchname'"),
    (["--dataset", str(REPO / "data" / "sft_example")], "add --task sft"),
    (["--init_from", "resume", "--out_dir", "/nonexistent/run"], "no checkpoint at"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no usable CUDA GPU")])


@pytest.mark.parametrize("args,words", BAD_STARTS, ids=[" ".join(a) for a, _ in BAD_STARTS])
def test_a_run_that_fails_at_start_changes_nothing(pretrained, tmp_path, args, words):
    """Bad options stop with one line naming them before out_dir is touched, even to overwrite."""
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    before = snapshot(folder)
    with pytest.raises(SystemExit) as stopped:
        train.main([*TINY, "--out_dir", str(folder), "--overwrite", "true", *args])
    message = str(stopped.value)
    assert words in message and message.startswith("error: ") and "\n" not in message, message
    assert snapshot(folder) == before


def test_sft_from_a_checkpoint_never_writes_into_its_folder(pretrained, tmp_path):
    """SFT from a checkpoint has its own out_dir; writing into the checkpoint's is refused."""
    _, cfg = train.parse_args("--config tiny --task sft --dataset data/sft_example".split())
    _, pre = train.parse_args(["--config", "tiny"])
    assert cfg.out_dir != pre.out_dir and "sft" in cfg.out_dir
    before = snapshot(pretrained)
    sft = ["--task", "sft", "--dataset", str(REPO / "data" / "sft_example"), "--init_from",
           str(pretrained / "ckpt_best.pt")]
    for extra in ([], ["--overwrite", "true"]):
        with pytest.raises(SystemExit, match="would write over the run it starts from"):
            run_train(pretrained, *sft, *extra, "--max_iters", "2")
        assert snapshot(pretrained) == before
    run_train(tmp_path / "sft", *sft, "--max_iters", "2", "--eval_interval", "2")
    assert load_checkpoint(tmp_path / "sft" / "ckpt_last.pt")["train_config"]["task"] == "sft"
    assert snapshot(pretrained) == before


# -----------------------------------------------------------------------------
# SFT: a right-padded batch

def test_padding_never_leaks_into_an_example():
    """An example's logits in a right-padded batch equal its logits alone."""
    torch.manual_seed(0)
    config = OrthrosConfig(vocab_size=257, n_layer=2, n_head=2, n_embd=16, window=4, max_seq_len=64)
    model = Orthros(config).double()
    tok = get_tokenizer("byte")
    pairs = [("the prompt is long here", "ok"), ("short", "a longer answer"), ("mid prompt", "yes")]
    x, _, _ = collate([dict(zip(("tokens", "mask"), encode_example(pair, tok))) for pair in pairs])
    tokens, _ = encode_example(["short", "a longer answer"], tok)
    alone, _ = model(torch.tensor([tokens[:-1]]))
    batched, _ = model(x)
    torch.testing.assert_close(batched[1, :len(tokens) - 1], alone[0], rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# sample.py

def run_sample(capsys, *args):
    """sample.main in this process: (stdout, the JSON line it ends with, if --json)."""
    sample.main(["--device", "cpu", *args])
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1]) if "--json" in args else None


def test_sample_seeds_its_sampling(pretrained, capsys):
    """Sampling (temperature 1) gives the same text for the same --seed, another for another."""
    texts = [run_sample(capsys, "--ckpt", f"{pretrained}/ckpt_last.pt", "--prompt", "def main():",
                        "--temperature", "1", "--max_new_tokens", "30", "--no_stop", "--seed", seed,
                        "--json")[1]["samples"][0] for seed in ("1", "1", "2")]
    assert texts[0] == texts[1] != texts[2] and texts[0].startswith("def main():")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("decoder", ["naive", "fast"])
def test_cuda_sample_repeats_its_seed_across_processes(pretrained, decoder):
    """On CUDA, two processes sampling with one --seed print one text; another seed, another."""
    def text(seed):
        run = subprocess.run([sys.executable, "sample.py", "--ckpt", f"{pretrained}/ckpt_last.pt",
                              "--device", "cuda", "--temperature", "1", "--max_new_tokens", "60",
                              "--no_stop", "--seed", seed, "--json", "--decoder", decoder],
                             cwd=REPO, capture_output=True, text=True, check=True)
        return json.loads(run.stdout.splitlines()[-1])["samples"]
    assert text("3") == text("3") != text("4")


def test_sample_finds_the_newest_checkpoint(pretrained, tmp_path, capsys):
    """Without --ckpt, sample.py loads the most recently written checkpoint under --out_dir."""
    older, newer = tmp_path / "a" / "ckpt_last.pt", tmp_path / "b" / "deeper" / "ckpt_best.pt"
    for path in (older, newer):
        path.parent.mkdir(parents=True)
        shutil.copy(pretrained / "ckpt_last.pt", path)
    os.utime(older, (1e9, 1e9))
    os.utime(newer, (2e9, 2e9))
    loaded = lambda: run_sample(capsys, "--out_dir", str(tmp_path), "--max_new_tokens", "3")[0]
    assert f"loaded {newer} " in loaded()
    os.utime(newer, (0.5e9, 0.5e9))
    assert f"loaded {older} " in loaded()


def test_sample_errors_are_clear(tmp_path, pretrained):
    """Each bad checkpoint, prompt or option stops sample.py with one line that names it."""
    tiny_ckpt = pretrained / "ckpt_last.pt"
    (tmp_path / "corrupt.pt").write_bytes(b"\x80\x02not a checkpoint")
    (tmp_path / "truncated.pt").write_bytes(tiny_ckpt.read_bytes()[:5000])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a whole module, not a state dict
    gpt2 = Orthros(OrthrosConfig(vocab_size=50257, n_layer=1, n_head=1, n_embd=8, max_seq_len=64))
    save_checkpoint(tmp_path / "gpt2.pt", model=gpt2.state_dict(), model_config=vars(gpt2.config),
                    tokenizer="gpt2", step=0)
    ckpt, of = ["--ckpt", str(tiny_ckpt)], lambda name: ["--ckpt", str(tmp_path / name)]
    cases = [(["--out_dir", str(tmp_path / "empty"), "--prompt", "x"], "no checkpoint"),
             ([*ckpt, "--prompt", ""], "prompt is empty"),
             ([*of("corrupt.pt"), "--prompt", "x"], "not a loadable checkpoint"),
             ([*of("truncated.pt"), "--prompt", "x"], "truncated or corrupt (it is not a complete"),
             ([*of("foreign.pt"), "--prompt", "x"], "not an orthros checkpoint"),
             ([*of("gpt2.pt"), "--prompt", "a <|endoftext|> b"], "<|endoftext|>"),
             ([*ckpt, "--prompt", "x", "--top_k", "0"], "--top_k must be >= 1"),
             ([*ckpt, "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
             ([*ckpt, "--prompt", "x", "--prompt_file", str(tmp_path / "latin1.txt")], "not both"),
             ([*ckpt, "--prompt_file", str(tmp_path / "latin1.txt")], "is not UTF-8 text"),
             ([*ckpt, "--prompt_file", str(tmp_path)], "is a folder"),
             ([*of("module.pt"), "--prompt", "x"], "object (torch.nn.modules.linear.Linear)"),
             ([*ckpt, "--prompt", "x" * 128], "fills the 128 tokens the model was trained on"),
             ([*ckpt, "--prompt", "x", "--chat"], "no chat template")]
    if not torch.cuda.is_available():  # a good checkpoint is not called corrupt without a GPU
        cases.append(([*ckpt, "--prompt", "x", "--device", "cuda"], "no usable CUDA GPU"))
    for args, words in cases:
        with pytest.raises(SystemExit) as stopped:
            sample.main(["--device", "cpu", *args])
        message = str(stopped.value.code)
        assert words in message and message.startswith("error: ") and "\n" not in message, args


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
        model.wte.weight[256] = 2 * direction  # the end token's logit is the largest for any input
    path = tmp_path_factory.mktemp("eot") / "ckpt.pt"
    save_checkpoint(path, model=model.state_dict(), model_config=vars(model.config),
                    tokenizer="byte", step=0)
    return path


def test_sample_stops_at_the_end_token_unless_asked_not_to(eager_to_end_ckpt, capsys):
    """Generation stops once every sample has made the end token (not shown); --no_stop goes on."""
    args = ["--ckpt", str(eager_to_end_ckpt), "--prompt", "abc", "--temperature", "0",
            "--max_new_tokens", "20", "--json"]
    out, result = run_sample(capsys, *args)
    assert result["new_tokens"] == 1 and result["samples"] == ["abc"] and "<|end|>" not in out
    _, result = run_sample(capsys, *args, "--no_stop")
    assert result["new_tokens"] == 20 and result["samples"] == ["abc" + "<|end|>" * 20]


def test_sample_ctrl_c_prints_one_line(pretrained):
    """sample.py under a real SIGINT while generating stops with one line, no traceback."""
    code, _, err = interrupted(["sample.py", "--device", "cpu", "--ckpt",
                                f"{pretrained}/ckpt_last.pt", "--prompt", "x", "--max_new_tokens",
                                "100000", "--no_stop"], "loaded")   # the load line: generating now
    assert code != 0 and err.strip() == "interrupted", err


def test_sample_on_a_cpu_leaves_busy_cores_alone(pretrained, monkeypatch, capsys):
    """On a CPU, sample.py runs a thread per core the load leaves free, or OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    default, ran = torch.get_num_threads(), []
    for load, omp in ((2.3, None), (0.2, None), (2.3, "2")):
        torch.set_num_threads(default)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        if omp:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        sample.main(["--ckpt", str(pretrained / "ckpt_last.pt"), "--max_new_tokens", "2",
                     "--device", "cpu"])
        ran.append(torch.get_num_threads())
    assert ran == [1, min(default, 2), default]
