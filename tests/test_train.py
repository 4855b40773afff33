"""
Tests for train.py and sample.py (and the checkpoints they write and read): CPU, offline, tiny models.

    python -m pytest -q tests/test_train.py
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

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
    """{step: loss}, {step: val loss} from a run's log.jsonl; each step and each evaluation logged once."""
    records = [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]
    for kind in ("loss", "val_loss"):
        steps = [r["step"] for r in records if kind in r]
        assert len(steps) == len(set(steps)), (kind, steps)
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["val_loss"] for r in records if "val_loss" in r})


def snapshot(folder):
    """{file name: bytes} of a folder: to show that a refused run changed nothing in it."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def untouched(folder):
    """{file name: (inode, mtime)} of a folder: a file rewritten with the same bytes still shows."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(Path(folder).iterdir())}


def at_step(monkeypatch, step, action):
    """Make training call action() as it starts step `step` (0-based), through train.lr_at."""
    real_lr_at = train.lr_at
    def lr_at(s, cfg):
        if s == step:
            action()
        return real_lr_at(s, cfg)
    monkeypatch.setattr(train, "lr_at", lr_at)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A finished tiny pre-training run of 10 steps: its folder (ckpt_last.pt, ckpt_best.pt, log.jsonl)."""
    out = tmp_path_factory.mktemp("pretrained")
    run_train(out, "--max_iters", "10", "--eval_interval", "10")
    return out


# -----------------------------------------------------------------------------
# Training, checkpoints, resuming

def test_tiny_config_trains_and_the_loss_falls(tmp_path):
    """A few dozen steps of the tiny config on CPU cut the validation loss clearly."""
    run_train(tmp_path, "--max_iters", "40", "--eval_interval", "20")
    _, evals = read_log(tmp_path)
    assert sorted(evals) == [0, 20, 40]
    assert evals[40] < evals[0] - 1.5  # from ~5.5 (uniform over 257 bytes) to below 4
    ckpt = load_checkpoint(tmp_path / "ckpt_last.pt")
    assert ckpt["step"] == 40 and ckpt["tokenizer"] == "byte" and ckpt["train_config"]["max_iters"] == 40
    assert (tmp_path / "ckpt_best.pt").exists()


def test_a_stop_request_saves_and_resuming_gives_the_same_losses(tmp_path, monkeypatch, capsys):
    """SIGINT during a step stops after it, saves ckpt_last.pt and prints the resume command; the resumed
    run logs the same losses as an uninterrupted one (model, optimizer, data and dropout states restored)."""
    args = ["--max_iters", "12", "--eval_interval", "10", "--dropout", "0.1"]
    run_train(tmp_path / "whole", *args)
    whole, _ = read_log(tmp_path / "whole")
    at_step(monkeypatch, 5, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "broken", *args)
    assert stopped.value.code == 130
    assert load_checkpoint(tmp_path / "broken" / "ckpt_last.pt")["step"] == 6  # step 6 finished, then saved
    out = capsys.readouterr().out
    assert "stopped by SIGINT after step 6" in out and "--init_from resume" in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored
    monkeypatch.undo()
    run_train(tmp_path / "broken", *args, "--init_from", "resume")
    resumed, _ = read_log(tmp_path / "broken")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(7, 13):
        assert resumed[step] == pytest.approx(whole[step], abs=1e-6), step


def test_epoch_order_takes_the_next_windows_and_keep_steps_keeps_weights(tmp_path, monkeypatch):
    """--data_order epoch: each micro-step takes the next batch_size windows of the run's order,
    counted from the step alone (a resumed run, and every model, gets the same data);
    --keep_steps saves those steps' weights alone, loadable."""
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


def test_a_repeated_sigterm_still_saves(tmp_path, monkeypatch):
    """SIGTERM twice (a supervisor's timeout, then its forwarded copy) still stops after the step and saves."""
    def sigterm_twice():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    at_step(monkeypatch, 3, sigterm_twice)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path, "--max_iters", "20", "--eval_interval", "10")
    assert stopped.value.code == 130
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 4


def test_ctrl_c_before_training_writes_nothing(tmp_path, monkeypatch):
    """Ctrl-C while the run is being set up ends it the way Python ends, and out_dir is never created."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "build_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_train(tmp_path / "run")
    assert not (tmp_path / "run").exists()


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


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    """A non-finite loss stops training with a clear message at the next read of the losses (every log_interval
    steps, and before each evaluation): it names the step, and the last checkpoint, which stays good, or says
    that none was written yet."""
    real_forward = Orthros.forward
    calls = {"n": 0, "from": 7}
    def forward_that_breaks(self, idx, targets=None, t_out=None):
        logits, loss = real_forward(self, idx, targets, t_out)
        if self.training:
            calls["n"] += 1
            if calls["n"] > calls["from"] and loss is not None:
                loss = loss * float("nan")
        return logits, loss
    monkeypatch.setattr(Orthros, "forward", forward_that_breaks)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "late", "--max_iters", "12", "--eval_interval", "5")   # nan from step 8; read at step 10
    ckpt = load_checkpoint(tmp_path / "late" / "ckpt_last.pt")
    assert ckpt["step"] == 5
    assert all(torch.isfinite(w).all() for w in ckpt["model"].values())
    message = str(stopped.value)
    assert "loss is nan at step 8 (read at step 10" in message and "ckpt_last.pt, step 5) is untouched" in message
    calls.update(n=0, **{"from": 2})
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path / "early", "--max_iters", "12", "--eval_interval", "5")   # nan from step 3; read before the eval
    message = str(stopped.value)
    assert "at step 3 (read at step 5" in message and "no checkpoint had been written yet" in message
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


def test_orthros_recalls_beyond_the_window_and_swa_does_not(recall_runs):
    """The recall task end to end (recall_micro: one layer, w = 16, trained from scratch on 2 CPU cores). A
    one-layer sliding-window model reaches the value of a pair at most w tokens back (distance <= w, the value
    w - 1 keys back): inside its window SWA recalls (>= 0.9), beyond it SWA guesses (at most chance + 0.1), and
    Orthros, whose output tokens attend to every key, recalls there too (>= 0.9)."""
    swa, orthros = ({b: (r["n"], r["accuracy"]) for b, r in json.loads((recall_runs[a] / "exact_match.json").read_text()).items()}
                    for a in ("swa", "orthros"))
    config = load_checkpoint(recall_runs["swa"] / "ckpt_last.pt")["model_config"]
    meta = json.loads((REPO / "data" / "recall_micro" / "meta.json").read_text())
    reach, chance = config["n_layer"] * config["window"], 1 / meta["params"]["n_values"]

    def pooled(scores, keep):  # the accuracy over every test example of the buckets lo-hi that keep(lo, hi)
        chosen = [scores[b] for b in scores if keep(*map(int, b.split("-")))]
        assert chosen, (scores, reach)
        return sum(n * acc for n, acc in chosen) / sum(n for n, _ in chosen)

    assert pooled(swa, lambda lo, hi: hi <= config["window"]) >= 0.9, swa
    assert pooled(swa, lambda lo, hi: lo > reach) <= chance + 0.1, swa
    assert pooled(orthros, lambda lo, hi: lo > reach) >= 0.9, orthros


def test_shape_options_ignored_by_a_checkpoint_are_reported(pretrained, tmp_path, capsys):
    """--init_from CKPT with another --n_embd says that the checkpoint's shape wins."""
    run_train(tmp_path, "--init_from", str(pretrained / "ckpt_last.pt"), "--n_embd", "128", "--max_iters", "1",
              "--eval_interval", "1")
    assert "--n_embd 128 ignored: the checkpoint's shape wins" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["model_config"]["n_embd"] == 64


def test_a_run_from_a_checkpoint_prints_and_saves_the_models_real_shape(pretrained, tmp_path, capsys):
    """Started from a checkpoint under a preset of another shape (small: 6 layers of width 384), the config line and
    the saved train_config show the checkpoint's shape (2 layers of width 64), not the preset's."""
    train.main(["--config", "small", "--device", "cpu", "--init_from", str(pretrained / "ckpt_last.pt"), "--seq_len", "64",
                "--batch_size", "2", "--max_iters", "0", "--eval_iters", "1", "--out_dir", str(tmp_path)])
    config_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("config small"))
    assert "n_layer=2, n_head=2, n_embd=64" in config_line and "n_layer=6" not in config_line
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["train_config"]["n_layer"] == 2


def test_a_run_from_a_checkpoint_counts_its_start_as_a_best(pretrained, tmp_path):
    """A run initialised from a checkpoint's weights saves its step-0 model as ckpt_best.pt, so ckpt_best.pt is never
    worse than the start: at lr 0, where no later evaluation is better, it stays the step-0 model."""
    run_train(tmp_path, "--init_from", str(pretrained / "ckpt_last.pt"), "--lr", "0", "--max_iters", "2", "--eval_interval", "1")
    _, evals = read_log(tmp_path)
    best = load_checkpoint(tmp_path / "ckpt_best.pt")
    assert best["step"] == 0 and best["best_val_loss"] == evals[0] == evals[2]


def test_an_improvement_writes_one_checkpoint_file_not_two(tmp_path):
    """When val improves, ckpt_best.pt is made the same file as ckpt_last.pt (a hard link), not written again; a later
    ckpt_last.pt is a new file, and ckpt_best.pt keeps its step."""
    run_train(tmp_path, "--max_iters", "2", "--eval_interval", "2")
    assert os.path.samefile(tmp_path / "ckpt_best.pt", tmp_path / "ckpt_last.pt")
    run_train(tmp_path, "--init_from", "resume", "--lr", "0", "--max_iters", "4", "--eval_interval", "2")  # no improvement
    assert not os.path.samefile(tmp_path / "ckpt_best.pt", tmp_path / "ckpt_last.pt")
    assert load_checkpoint(tmp_path / "ckpt_best.pt")["step"] == 2 and load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 4


def test_resuming_a_finished_run_says_there_is_nothing_to_do_and_writes_nothing(pretrained, tmp_path, capsys):
    """--init_from resume of a run already at --max_iters prints one line, that there is nothing to do, and touches no
    file of the run (not even rewriting ckpt_last.pt with the same bytes)."""
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    before = untouched(folder)
    capsys.readouterr()
    run_train(folder, "--init_from", "resume", "--max_iters", "10")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nothing to do") and "ckpt_best" not in lines[0], lines
    assert untouched(folder) == before


def test_a_resumed_run_that_does_not_improve_names_its_earlier_best(pretrained, tmp_path, capsys):
    """A resumed run whose evaluations do not beat the best before it ends by naming that ckpt_best.pt (still there),
    not by saying there is none."""
    folder = tmp_path / "run"
    shutil.copytree(pretrained, folder)
    run_train(folder, "--init_from", "resume", "--lr", "0", "--max_iters", "11", "--eval_interval", "11")
    done = capsys.readouterr().out.splitlines()[-1]
    assert "(ckpt_best.pt, before this resume)" in done and "no ckpt_best.pt" not in done, done
    assert load_checkpoint(folder / "ckpt_best.pt")["step"] == 10


def test_the_printed_resume_command_gives_back_the_same_options(monkeypatch):
    """The resume command is quoted for the shell: an empty value and one with a space read back as the same
    options, with --init_from resume instead of the run's --init_from and --overwrite."""
    monkeypatch.setattr(train, "resumed", lambda cfg, given: ("tiny", cfg))  # no run to read
    argv = ["--config", "tiny", "--curriculum", "", "--dataset", "my data", "--init_from", "old run/ckpt.pt", "--overwrite=true"]
    words = shlex.split(resume_command(argv))
    assert words == ["python", "train.py", "--config", "tiny", "--curriculum", "", "--dataset", "my data", "--init_from", "resume"]
    _, cfg = train.parse_args(words[2:])
    assert (cfg.curriculum, cfg.dataset, cfg.init_from) == ("", "my data", "resume")


def test_resume_restores_the_runs_options_and_says_which_given_ones_change_them(tmp_path, capsys):
    """--init_from resume trains on with the options the run saved (its lr 1e-4, not the preset's
    3e-3); an option given again overrides its saved value, and the start-up line names it with the
    value it replaces."""
    saved = {**vars(train.TrainConfig(**train.CONFIGS["tiny"])), "lr": 1e-4, "max_iters": 200}
    save_checkpoint(tmp_path / "ckpt_last.pt", step=200, config_name="tiny", train_config=saved)
    capsys.readouterr()
    name, cfg = train.parse_args(["--config", "tiny", "--init_from", "resume", "--out_dir",
                                  str(tmp_path), "--max_iters", "400", "--warmup_iters", "10"])
    assert (name, cfg.lr, cfg.max_iters, cfg.init_from) == ("tiny", 1e-4, 400, "resume")
    assert capsys.readouterr().out == (f"note: resuming {tmp_path}/ckpt_last.pt with its run's "
                                       "options, but --max_iters 400 (was 200)\n")


def test_a_pretrained_model_starts_at_a_lower_lr_unless_one_is_given(capsys):
    """--init_from hf:DIR without --lr trains at train.PRETRAINED_LR (1e-4), not the preset's lr (tuned for training from
    scratch), and says so in a note; a given --lr wins, and this repo's checkpoints keep their preset's lr."""
    _, cfg = train.parse_args(["--config", "small", "--init_from", "hf:models/SmolLM2-135M"])
    assert cfg.lr == train.PRETRAINED_LR == 1e-4 and "note: lr 0.0001" in capsys.readouterr().out
    _, cfg = train.parse_args(["--config", "small", "--init_from", "hf:models/SmolLM2-135M", "--lr", "3e-4"])
    assert cfg.lr == 3e-4 and "note: lr" not in capsys.readouterr().out
    _, cfg = train.parse_args(["--config", "tiny", "--init_from", "out/tiny-orthros/ckpt_best.pt"])
    assert cfg.lr == 3e-3


# -----------------------------------------------------------------------------
# What a run prints and logs

def test_an_eval_is_not_counted_in_the_next_steps_speed(tmp_path, monkeypatch):
    """ms/step, tokens/s and MFU are measured over the steps between two reads of the device, an evaluation
    excluded: on a clock that gives every step 1 s and every evaluation 100 s, the last step before each read
    logs 1000 ms, its tokens per second, and (on a device whose peak is known: here 1 TFLOP/s, as if a GPU)
    perf/flops.py's count of its FLOPs per second over that peak."""
    clock = {"now": 0.0}
    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(train, "peak_flops", lambda device: 1e12)
    real_step, real_evaluate = train.Run.train_step, train.Run.evaluate
    def train_step(self, model):
        clock["now"] += 1.0
        return real_step(self, model)
    def evaluate(self):
        clock["now"] += 100.0
        return real_evaluate(self)
    monkeypatch.setattr(train.Run, "train_step", train_step)
    monkeypatch.setattr(train.Run, "evaluate", evaluate)
    run_train(tmp_path, "--max_iters", "9", "--eval_interval", "3", "--log_interval", "2")   # reads at 2, 3, 4, 6, 8, 9
    steps = [r for r in map(json.loads, open(tmp_path / "log.jsonl")) if "ms_per_step" in r]
    assert [r["step"] for r in steps] == [2, 3, 4, 6, 8, 9]
    assert [r["ms_per_step"] for r in steps] == [1000.0] * 6
    assert [r["tok_per_s"] for r in steps] == [16 * 128] * 6   # batch 16 x seq_len 128 tokens in 1 s
    config = OrthrosConfig(**load_checkpoint(tmp_path / "ckpt_last.pt")["model_config"])
    assert [r["mfu"] for r in steps] == pytest.approx([3 * 16 * forward_flops(config, 128, 128) / 1e12] * 6)   # forward + backward


HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "numpy"}
TENSOR_METHODS = {str(Path(torch.__file__).parent / name) for name in ("overrides.py", "_tensor.py")}  # e.g. __format__


def test_train_py_reads_the_device_only_every_log_interval(tmp_path, monkeypatch):
    """train.py's own lines take a tensor's value into Python (.item(), .tolist(), float(), bool(), ...: on a GPU each
    makes the CPU wait for the device) only at the reads, every log_interval steps and before each evaluation: the
    steps in between queue their work without waiting. Every step's loss is still logged."""
    under_way, reads = {"step": 0}, set()
    real_lr_at = train.lr_at
    def lr_at(step, cfg):  # called as each step starts
        under_way["step"] = step + 1
        return real_lr_at(step, cfg)
    monkeypatch.setattr(train, "lr_at", lr_at)

    class HostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in HOST_READS:
                caller = sys._getframe(1)
                while caller.f_code.co_filename in TENSOR_METHODS:
                    caller = caller.f_back
                if Path(caller.f_code.co_filename) == Path(train.__file__) and caller.f_code.co_name != "evaluate":
                    reads.add(under_way["step"])
            return func(*args, **(kwargs or {}))

    with HostReads():
        run_train(tmp_path, "--max_iters", "12", "--log_interval", "5", "--eval_interval", "8")
    assert reads == {5, 8, 10, 12}
    losses, _ = read_log(tmp_path)
    assert sorted(losses) == list(range(1, 13))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_cuda_steps_between_reads_never_wait_for_the_gpu(tmp_path, monkeypatch, task):
    """On a GPU no step makes the CPU wait: with torch's sync debug mode raising at any synchronizing call (an .item(),
    a copy from pageable memory, ...) everywhere but in the reads, the evaluations and the checkpoints, from the first
    read on, 12 steps with a read every 4 run to the end: 8 steps checked. SFT runs with a window longer than every
    example, so that no FlexAttention kernel is compiled for a new length after the first read."""
    torch._dynamo.reset()  # FlexAttention compiled afresh: earlier tests' many lengths can exhaust its recompile limit (then eager)
    state = {"armed": False, "checked": 0}
    def may_wait(function, arms=False):
        def wrapped(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("default")
            try:
                return function(*args, **kwargs)
            finally:
                state["armed"] |= arms  # the first interval warms up: compiles, allocations, cuBLAS
                torch.cuda.set_sync_debug_mode("error" if state["armed"] else "default")
        return wrapped
    real_step = train.Run.train_step
    def train_step(self, model):
        state["checked"] += torch.cuda.get_sync_debug_mode() == 2
        return real_step(self, model)
    monkeypatch.setattr(train.Run, "train_step", train_step)
    monkeypatch.setattr(train.Run, "read", may_wait(train.Run.read, arms=True))
    for name in ("evaluate", "checkpoint"):
        monkeypatch.setattr(train.Run, name, may_wait(getattr(train.Run, name)))
    monkeypatch.setattr(train, "sft_report", may_wait(train.sft_report))
    data = ["--task", "sft", "--dataset", str(REPO / "data" / "sft_example"), "--window", "128"] if task == "sft" else []
    try:
        run_train(tmp_path, "--device", "cuda", *data, "--max_iters", "12", "--log_interval", "4", "--eval_interval", "12")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state["checked"] == 8
    assert sorted(read_log(tmp_path)[0]) == list(range(1, 13))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_log_their_mfu_and_memory(tmp_path):
    """On a GPU that perf/flops.py knows, the record of each read holds the MFU (a fraction in (0, 1)) and the peak memory."""
    run_train(tmp_path, "--device", "cuda", "--max_iters", "6", "--eval_interval", "6", "--log_interval", "2")
    steps = [r for r in map(json.loads, open(tmp_path / "log.jsonl")) if "ms_per_step" in r]
    assert len(steps) == 3 and all(0 < r["mfu"] < 1 and r["max_memory_gb"] > 0 for r in steps), steps


def test_a_run_into_a_file_logs_one_line_per_interval(tmp_path):
    """With its output in a file (as on a cluster), train.py draws no progress bars: no carriage
    returns, one line per log_interval steps, a few dozen lines for a tiny run."""
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "train.py", *TINY, "--out_dir", str(tmp_path / "run"), "--max_iters", "30",
                        "--eval_interval", "15", "--log_interval", "5", "--batch_size", "4", "--seq_len", "32"], cwd=REPO,
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    text = log.read_text()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) <= 20, text
    assert [line.split(":")[0] for line in lines if "tok/s" in line] == [f"step {s}" for s in range(5, 31, 5)]
    assert sum(line.startswith("step") and "val loss" in line for line in lines) == 3
    assert lines[-1].startswith("done: 30 steps")


def interrupted(args, started):
    """Run python -u *args, send SIGINT once a line of its output starts with `started`: (exit code, rest of stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-u", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(started):
            break
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()   # a hang fails the test and leaves no process behind
    return proc.returncode, out, err


def test_ctrl_c_in_a_real_process_saves_and_prints_how_to_resume(tmp_path):
    """train.py under a real SIGINT, once it is logging steps, exits with code 130 and no traceback, having
    saved ckpt_last.pt and printed the command that resumes."""
    code, out, err = interrupted(["train.py", *TINY, "--out_dir", str(tmp_path), "--max_iters", "100000",
                                  "--eval_interval", "100000", "--log_interval", "1"], "step 1:")
    assert code == 130, err
    assert "Traceback" not in err and "Resume with: python train.py" in out
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] >= 1


def test_help_lists_every_option_with_its_help_and_the_configs(capsys):
    """train.py --help shows each TrainConfig field with its help text, and what every named config sets."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields(train.TrainConfig):
        assert f"--{f.name}" in text and " ".join(f.metadata["help"].split()) in text, f.name
    for name, preset in train.CONFIGS.items():
        assert name in text and all(f"{k}={v}" in text for k, v in preset.items())


# -----------------------------------------------------------------------------
# Bad input: one line, and nothing touched

def test_bad_options_are_clear_errors():
    """Unknown configs, unknown keys and badly typed values stop with a message naming them."""
    for argv, words in [(["--config", "huge"], "--config invalid choice: 'huge'"), (["--lrr", "1"], "unknown option --lrr"),
                        (["--lr", "fast"], "--lr takes a float"), (["--compile", "maybe"], "true or false"),
                        (["--beta2", "1"], "--beta2 must be in [0, 1)"), (["--task", "rl"], "--task must be one of")]:
        with pytest.raises(SystemExit, match=re.escape(words)):
            train.parse_args(argv)
    name, cfg = train.parse_args(["--config", "tiny", "--attn=swa", "--scale_offset", "false"])
    assert (name, cfg.attn, cfg.scale_offset, cfg.n_embd) == ("tiny", "swa", False, 64)


def test_without_a_config_on_a_cpu_one_line_names_the_laptop_config(monkeypatch, capsys):
    """`python train.py` with no --config runs small, a GPU config; without a GPU it says so and names --config tiny."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name, _ = train.parse_args([])
    out = capsys.readouterr().out
    assert name == "small" and len(out.splitlines()) == 1 and "--config tiny" in out


BAD_STARTS = [
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
    assert snapshot(folder) == before


def test_a_failure_inside_torch_at_setup_keeps_its_traceback(tmp_path, monkeypatch):
    """An error that is not ours (torch's, as a CUDA or NCCL failure would be) is not cut to one line:
    it propagates whole, with its traceback; nothing is written."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA")
    monkeypatch.setattr(torch.optim, "AdamW", broken)
    with pytest.raises(RuntimeError, match="illegal memory access(.|\n)*TORCH_USE_CUDA_DSA"):
        run_train(tmp_path / "run")
    assert not (tmp_path / "run").exists()


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


def test_max_iters_zero_saves_the_initial_model_and_says_so(tmp_path, capsys):
    """--max_iters 0 evaluates and saves the initial model; the closing line says what was written."""
    run_train(tmp_path, "--max_iters", "0")
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 0
    assert not (tmp_path / "ckpt_best.pt").exists()
    assert "no ckpt_best.pt" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# SFT: the T_in / T_out split, the shipped example, buckets, truncation

def test_padding_never_leaks_into_an_example():
    """An example's logits in a right-padded batch equal its logits alone."""
    torch.manual_seed(0)
    model = Orthros(OrthrosConfig(vocab_size=257, n_layer=2, n_head=2, n_embd=16, window=4, max_seq_len=64)).double()
    tok = get_tokenizer("byte")
    pairs = [("the prompt is long here", "ok"), ("short", "a longer answer"), ("mid prompt", "yes")]
    x, _, _ = collate([dict(zip(("tokens", "mask"), encode_example([p, r], tok))) for p, r in pairs])
    tokens, _ = encode_example(["short", "a longer answer"], tok)
    alone, _ = model(torch.tensor([tokens[:-1]]))
    batched, _ = model(x)
    torch.testing.assert_close(batched[1, :len(tokens) - 1], alone[0], rtol=0, atol=1e-12)


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


# -----------------------------------------------------------------------------
# sample.py

def run_sample(capsys, *args):
    """sample.main in this process: (stdout, the JSON line it ends with, if --json)."""
    sample.main(["--device", "cpu", *args])
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1]) if "--json" in args else None


def test_sample_seeds_its_sampling(pretrained, capsys):
    """Sampling (temperature 1) gives the same text for the same --seed, and another text for another seed."""
    texts = [run_sample(capsys, "--ckpt", str(pretrained / "ckpt_last.pt"), "--prompt", "def main():", "--temperature",
                        "1", "--max_new_tokens", "30", "--no_stop", "--seed", seed, "--json")[1]["samples"][0]
             for seed in ("1", "1", "2")]
    assert texts[0] == texts[1] != texts[2] and texts[0].startswith("def main():")


def test_sample_decodes_with_the_naive_cache_unless_asked(pretrained, capsys, monkeypatch):
    """sample.py runs orthros.py's decoder by default (no tip on CPU); --decoder fast gives the same greedy
    text, says on CPU that it is built for GPUs, and prints its one-time cost on a line of its own, outside
    the time to first token (here a warm-up made 2 s longer)."""
    from perf.engine import FastDecoder
    warm_up = FastDecoder.warm_up
    monkeypatch.setattr(FastDecoder, "warm_up", lambda *a: (time.sleep(2), warm_up(*a)))
    args = ("--ckpt", str(pretrained / "ckpt_last.pt"), "--prompt", "def main():", "--temperature", "0",
            "--max_new_tokens", "40", "--no_stop", "--json")
    naive_out, naive = run_sample(capsys, *args)
    fast_out, fast = run_sample(capsys, *args, "--decoder", "fast")
    assert "naive decoder)" in naive_out and "fast decoder)" in fast_out and "tip:" not in naive_out
    assert naive["samples"] == fast["samples"] and naive["new_tokens"] == 40
    assert naive["setup_s"] is None and "ready" not in naive_out and "note: --decoder fast is built for CUDA" in fast_out
    line = next(line for line in fast_out.splitlines() if line.startswith("fast decoder ready: "))
    assert line.endswith(" s (its CUDA graph captured)") and fast["setup_s"] >= 2 > fast["ttft_ms"] / 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("decoder", ["naive", "fast"])
def test_cuda_sample_repeats_its_seed_across_processes(pretrained, decoder):
    """On CUDA, sampling at temperature 1: two processes with the same --seed print the same text, and a
    third with another seed another text."""
    def text(seed):
        run = subprocess.run([sys.executable, "sample.py", "--ckpt", str(pretrained / "ckpt_last.pt"), "--device", "cuda",
                              "--temperature", "1", "--max_new_tokens", "60", "--no_stop", "--seed", seed, "--json",
                              "--decoder", decoder], cwd=REPO, capture_output=True, text=True, check=True)
        return json.loads(run.stdout.splitlines()[-1])["samples"]
    assert text("3") == text("3") != text("4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sample_suggests_the_fast_decoder(pretrained, capsys):
    """On CUDA, the naive default prints a one-line tip naming --decoder fast; with it, no tip."""
    args = ("--ckpt", str(pretrained / "ckpt_last.pt"), "--prompt", "x", "--max_new_tokens", "5", "--device", "cuda")
    sample.main(list(args))
    out = capsys.readouterr().out
    assert sum(line.startswith("tip:") and "--decoder fast" in line for line in out.splitlines()) == 1
    sample.main([*args, "--decoder", "fast"])
    assert "tip:" not in capsys.readouterr().out


def test_sample_on_a_cpu_leaves_busy_cores_alone(pretrained, monkeypatch, capsys):
    """sample.py on a CPU runs as many threads as the 1-minute load average leaves cores free (at
    least one, at most torch's default), unless OMP_NUM_THREADS names a number: with both of 2
    cores busy, one thread."""
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


def test_sample_finds_the_newest_checkpoint(pretrained, tmp_path, capsys):
    """Without --ckpt, sample.py loads the most recently written checkpoint under --out_dir, in any subfolder."""
    import shutil
    older, newer = tmp_path / "a" / "ckpt_last.pt", tmp_path / "b" / "deeper" / "ckpt_best.pt"
    for path in (older, newer):
        path.parent.mkdir(parents=True)
        shutil.copy(pretrained / "ckpt_last.pt", path)
    os.utime(older, (1e9, 1e9))
    os.utime(newer, (2e9, 2e9))
    assert f"loaded {newer} " in run_sample(capsys, "--out_dir", str(tmp_path), "--max_new_tokens", "3")[0]
    os.utime(newer, (0.5e9, 0.5e9))
    assert f"loaded {older} " in run_sample(capsys, "--out_dir", str(tmp_path), "--max_new_tokens", "3")[0]


def test_sample_errors_are_clear(tmp_path, pretrained):
    """No checkpoint, an empty prompt, a corrupt, truncated or foreign file, a saved module, an unencodable prompt,
    bad sampling options, a non-UTF-8 prompt file or a folder, a prompt that fills the model's context, --chat
    without a chat template, a missing GPU: one clear line each."""
    tiny_ckpt = pretrained / "ckpt_last.pt"
    (tmp_path / "corrupt.pt").write_bytes(b"\x80\x02not a checkpoint")
    (tmp_path / "truncated.pt").write_bytes(tiny_ckpt.read_bytes()[:5000])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a whole module, not a state dict
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
             ([*ckpt, "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
             ([*ckpt, "--prompt", "x", "--prompt_file", str(tmp_path / "latin1.txt")], "not both"),
             ([*ckpt, "--prompt_file", str(tmp_path / "latin1.txt")], "is not UTF-8 text"),
             ([*ckpt, "--prompt_file", str(tmp_path)], "is a folder"),
             (["--ckpt", str(tmp_path / "module.pt"), "--prompt", "x"], "holds a Python object (torch.nn.modules.linear.Linear)"),
             ([*ckpt, "--prompt", "x" * 128], "fills the 128 tokens the model was trained on"),
             ([*ckpt, "--prompt", "x", "--chat"], "no chat template")]
    if not torch.cuda.is_available():  # a good checkpoint is not called corrupt when the GPU is missing
        cases.append(([*ckpt, "--prompt", "x", "--device", "cuda"], "no usable CUDA GPU"))
    for args, words in cases:
        with pytest.raises(SystemExit) as stopped:
            sample.main(["--device", "cpu", *args])
        message = str(stopped.value.code)
        assert words in message and message.startswith("error: ") and "\n" not in message, (args, message)


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


def test_sample_stops_at_the_end_token_unless_asked_not_to(eager_to_end_ckpt, capsys):
    """Generation stops once every sample has produced the end token (not shown); --no_stop goes on."""
    args = ["--ckpt", str(eager_to_end_ckpt), "--prompt", "abc", "--temperature", "0", "--max_new_tokens", "20", "--json"]
    out, result = run_sample(capsys, *args)
    assert result["new_tokens"] == 1 and result["samples"] == ["abc"] and "<|end|>" not in out
    _, result = run_sample(capsys, *args, "--no_stop")
    assert result["new_tokens"] == 20 and result["samples"] == ["abc" + "<|end|>" * 20]


def test_sample_defaults_fit_the_model(pretrained, capsys):
    """With no prompt it continues a newline; the default --max_new_tokens fits a tiny model (max_seq_len 128)
    with no 'longer than' note; asking for more than fits prints it once."""
    out, result = run_sample(capsys, "--ckpt", str(pretrained / "ckpt_last.pt"), "--json")
    assert "longer than" not in out and result["prompt_tokens"] == 1 and result["samples"][0].startswith("\n")
    out, _ = run_sample(capsys, "--ckpt", str(pretrained / "ckpt_last.pt"), "--prompt", "def fibonacci(n):",
                        "--max_new_tokens", "300", "--no_stop")
    assert out.count("longer than") == 1


def test_sample_ctrl_c_prints_one_line(pretrained):
    """sample.py under a real SIGINT while generating stops with one line, no traceback."""
    code, _, err = interrupted(["sample.py", "--device", "cpu", "--ckpt", str(pretrained / "ckpt_last.pt"), "--prompt",
                                "x", "--max_new_tokens", "100000", "--no_stop"], "loaded")   # the load line: generating
    assert code != 0 and err.strip() == "interrupted", err
