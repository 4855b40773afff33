"""train.py under torchrun on CPU (gloo): DDP and FSDP2 against one process; a stop."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sample
import train
from checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
# Within the warmup (tiny's is 10 steps) the learning rate does not depend on max_iters: a run of 2
# steps resumed to 4 follows the same schedule as a run of 4.
COMMON = "--config tiny --device cpu --eval_iters 1 --eval_interval 2 --lr 1e-2".split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "train.py", *COMMON, "--batch_size", "4"]   # 2 processes, each with half of batch 8


def torchrun(out_dir, *args):
    return subprocess.run([*TORCHRUN, "--out_dir", str(out_dir), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True)


def losses(out_dir):
    records = map(json.loads, open(Path(out_dir) / "log.jsonl"))
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """SFT data whose responses run from 1 to 40 characters (a batch's halves hold different
    numbers of targets), and the losses of 4 steps on it in one process, batch 8."""
    data, rng = tmp_path_factory.mktemp("sft_data"), random.Random(0)
    for split, n in (("train", 64), ("val", 16)):
        examples = [{"prompt": f"say {i}:", "response": "ab"[i % 2] * rng.randint(1, 40)}
                    for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    args = ["--task", "sft", "--dataset", str(data), "--eval_exact_match", "0"]
    out = tmp_path_factory.mktemp("sft_one")
    train.main([*COMMON, *args, "--max_iters", "4", "--batch_size", "8", "--out_dir", str(out)])
    return args, losses(out)


def test_ddp_then_fsdp_resumed_give_one_process_losses_and_a_checkpoint_sample_reads(tmp_path, sft,
                                                                                    capsys):
    """DDP, then FSDP resuming it, give one process's losses and checkpoints sample.py reads."""
    # SFT's loss is the mean over the targets of the whole global batch, not a mean of each
    # process's means; the two processes slice each global batch as pre-training's do.
    args, one = sft
    ddp = torchrun(tmp_path, *args, "--max_iters", "2")
    assert ddp.returncode == 0, ddp.stderr
    assert load_checkpoint(tmp_path / "ckpt_last.pt")["step"] == 2
    fsdp = torchrun(tmp_path, *args, "--fsdp", "true", "--activation_checkpointing", "true",
                    "--max_iters", "4", "--init_from", "resume")
    assert fsdp.returncode == 0, fsdp.stderr
    assert losses(tmp_path) == pytest.approx(one, abs=1e-5)
    ckpt = load_checkpoint(tmp_path / "ckpt_last.pt")
    assert ckpt["step"] == 4 and "blocks.0.attn.c_q.weight" in ckpt["optimizer"]["state"]
    assert all(type(w).__name__ == "Tensor" for w in ckpt["model"].values())   # no DTensor shards
    sample.main(["--ckpt", f"{tmp_path}/ckpt_last.pt", "--device", "cpu", "--max_new_tokens", "5"])
    assert "loaded" in capsys.readouterr().out


def test_sft_with_gradient_accumulation_gives_one_big_batch_losses(tmp_path, sft):
    """Two micro-steps of 4 give the losses of one batch of 8, with targets of many lengths."""
    args, one = sft
    train.main([*COMMON, *args, "--max_iters", "4", "--batch_size", "4", "--grad_accum", "2",
                "--out_dir", str(tmp_path)])
    assert losses(tmp_path) == pytest.approx(one, abs=1e-5)


def test_a_stop_request_on_one_process_stops_both_at_the_next_read(tmp_path):
    """A SIGTERM to rank 1 stops both ranks at the next read (every 3 steps), where rank 0 saves."""
    proc = subprocess.Popen([*TORCHRUN, "--max_iters", "100000", "--eval_interval", "100000",
                             "--log_interval", "3", "--out_dir", str(tmp_path)], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # training has started on both processes
        if line.startswith("step 6:"):
            break
    rank1 = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
             if open(f"/proc/{pid}/stat").read().split()[3] == str(proc.pid)
             and b"\0RANK=1\0" in b"\0" + open(f"/proc/{pid}/environ", "rb").read()]
    os.kill(rank1[0], signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)   # a hang would end here, as a failure
    finally:
        proc.kill()
    assert "stopped by a stop request on another rank" in out, out + err[-3000:]
    step = load_checkpoint(tmp_path / "ckpt_last.pt")["step"]
    assert step % 3 == 0 and f"after step {step}; saved" in out
