"""repro/experiments.py's own logic: seed statistics, resumable run states, stops, NIAH needles."""

import signal
import sys
import time
from pathlib import Path

import pytest

from repro import experiments as ex
from checkpoint import load_checkpoint, save_checkpoint
from data.recall.prepare import PRESETS
from data.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_stats_and_compare_against_the_spread_and_per_seed():
    assert ex.stats([1.0, 2.0, 3.0]) == {"values": [1.0, 2.0, 3.0], "mean": 2.0, "std": 1.0}
    a, b = ex.stats([0.80, 0.81, 0.82]), ex.stats([0.90, 0.95, 0.85])
    c = ex.compare("a", "b", a, b, "loss")
    assert c["diff_mean"] == pytest.approx(-0.09) and c["spread"] == pytest.approx(0.01 + 0.05)
    assert c["larger_than_spread"] and c["same_sign_every_seed"]
    assert c["per_seed_diffs"] == pytest.approx([-0.10, -0.14, -0.03])
    close = ex.compare("a", "b", ex.stats([1.0, 1.2]), ex.stats([1.1, 1.05]), "loss")
    assert not close["larger_than_spread"] and not close["same_sign_every_seed"]
    single = ex.compare("a", "b", ex.stats([1.0]), ex.stats([2.0]), "loss")   # one seed: no std
    keys = ("spread", "larger_than_spread", "same_sign_every_seed")
    assert ex.stats([0.5])["std"] is None and {single[k] for k in keys} == {None}


def fake_run(tmp_path, **kw):
    return ex.Run(tmp_path / "run", "--config tiny --max_iters 10 --seed 1338".split(), **kw)


def save_fake_checkpoint(run, step, **config):
    save_checkpoint(run.out_dir / "ckpt_last.pt", step=step, config_name="tiny",
                    train_config={"max_iters": 10, "seed": 1338, "init_from": "scratch", **config})


def test_run_state_fresh_overwrite_resume_done(tmp_path):
    run = fake_run(tmp_path)
    assert ex.run_state(run) == "fresh"
    run.out_dir.mkdir()
    assert ex.run_state(run) == "fresh"          # an empty folder
    (run.out_dir / "log.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
    assert ex.run_state(run) == "overwrite"      # died before its first checkpoint
    save_fake_checkpoint(run, 5)
    assert ex.run_state(run) == "resume"
    save_fake_checkpoint(run, 10, init_from="resume")  # a resumed run records init_from=resume
    assert ex.run_state(run) == "done"
    assert run.log.parent == run.out_dir.parent  # the launcher's log is not inside the run's folder
    run = fake_run(tmp_path, exact_match=True)    # done only once it wrote exact_match.json
    assert ex.run_state(run) == "resume"         # train.py, resumed at the last step, writes it
    (run.out_dir / "exact_match.json").write_text("{}")
    assert ex.run_state(run) == "done"
    save_fake_checkpoint(run, 5, seed=1337)
    with pytest.raises(SystemExit, match="holds another run.*--seed 1337 there, '1338' here"):
        ex.run_state(run)
    run = ex.Run(tmp_path / "eval", ["--config", "tiny", "--max_iters", "0"])
    run.out_dir.mkdir()
    (run.out_dir / "log.jsonl").write_text('{"step": 0, "val_loss": 5.0}\n')
    assert ex.run_state(run) == "done"            # evaluation only: done from its log


def test_run_all_fails_clearly_and_stops_at_the_time_limit(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    ok = ([sys.executable, "-c", "print('fine')"], tmp_path / "ok.log")
    bad = ([sys.executable, "-c", "import sys; print('boom'); sys.exit(2)"], tmp_path / "bad.log")
    with pytest.raises(SystemExit) as failed:
        ex.run_all([ok, bad], parallel=2, deadline=None)
    assert failed.value.code == 1
    assert "failed (2)" in capsys.readouterr().err and "boom" in (tmp_path / "bad.log").read_text()
    # A training past the deadline gets SIGTERM; here it saves its "checkpoint" in its handler.
    saver = ("import signal, sys, time, pathlib\n"
             "def save(*a): pathlib.Path(sys.argv[1]).write_text('saved'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, save); print('ready', flush=True); time.sleep(60)")
    sleeper = ([sys.executable, "-c", saver, str(tmp_path / "saved")], tmp_path / "sleep.log")
    t0 = time.time()
    with pytest.raises(SystemExit) as stop:
        ex.run_all([sleeper], parallel=1, deadline=time.time() + 2)
    assert stop.value.code == 3 and time.time() - t0 < 30
    assert (tmp_path / "saved").read_text() == "saved"
    assert "--time_limit" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # the handler was put back


def test_gap_pairs_differ_only_in_the_model_and_compare_over_the_steps_both_runs_reached():
    """Two runs of one seed differ by their model alone, compared up to the step both reached."""
    runs = ex.gap_runs({"out": Path("out"), **ex.SCALES["gpu"]}, [1337, 1338])
    model_options = {"attn", "scale_offset"}
    for a, b in ex.GAP_COMPARISONS:
        for seed in (1337, 1338):
            given_a, given_b = (runs[arm, seed].given for arm in (a, b))
            differ = {k for k in given_a | given_b if given_a.get(k) != given_b.get(k)}
            assert differ and differ <= model_options, (a, b, differ)
    # A run cut short is compared with its twin's best up to the same step; step 0 never counts.
    rec = lambda step, val: {"step": step, "train_loss": val - 0.1, "val_loss": val}
    evals = {("a", 1337): {0: rec(0, 0.5), 100: rec(100, 2.0), 200: rec(200, 1.5)},
             ("b", 1337): {0: rec(0, 0.5), 100: rec(100, 2.2)},
             ("a", 1338): {0: rec(0, 5.0), 100: rec(100, 1.9)}}   # b's seed 1338 never evaluated
    c = ex.gap_compare(evals, "a", "b", [1337, 1338])
    assert list(c["per_seed"]) == [1337] and c["per_seed"][1337]["up_to_step"] == 100
    assert c["mean"] == pytest.approx(-0.2) and c["std"] is None
    summary = ex.gap_summary(evals["a", 1337], max_iters=300)
    assert (summary["best_val"], summary["best_step"], summary["finished"]) == (1.5, 200, False)
    assert summary["train_at_best"] == pytest.approx(1.4) and summary["val"] == [0.5, 2.0, 1.5]


def test_niah_needles_sit_at_their_depth():
    tok = get_tokenizer("byte")
    lens, depths = [64, 100], [0.0, 0.5, 1.0]
    examples = ex.niah_examples(lens, depths, 3, PRESETS["tiny"], tok)
    assert len(examples) == len(lens) * len(depths) * 3
    for e in examples:
        L, depth = e["bucket"].split(":")
        L, depth = int(L), float(depth)
        assert len(e["tokens"]) == L + 2 + 2          # context, "?K", then the value and END
        query_key = e["tokens"][L + 1]
        needle = L + 1 - ex.needle_distance(L, depth)
        assert e["tokens"][needle] == query_key and e["tokens"][needle + 1] == e["tokens"][L + 2]
    assert ex.needle_distance(64, 0.0) == 65 and ex.needle_distance(64, 1.0) == 3


def test_launch_skips_finished_runs_and_resumes_partial_ones(tmp_path, monkeypatch, capsys):
    """With train.py: a run trains once; cut back to step 2 it resumes there; finished, skipped."""
    monkeypatch.chdir(REPO)
    run = ex.Run(tmp_path / "lm", ["--config", "tiny", "--max_iters", "4", "--eval_interval", "2",
                                   "--eval_iters", "1", "--batch_size", "2", "--device", "cpu"])
    S = {"parallel": 1, "deadline": None}
    ex.launch([run], S)
    assert ex.run_state(run) == "done"
    ckpt = load_checkpoint(run.out_dir / "ckpt_last.pt")
    save_checkpoint(run.out_dir / "ckpt_last.pt", **{**ckpt, "step": 2})  # as if stopped at step 2
    assert ex.run_state(run) == "resume"
    capsys.readouterr()
    ex.launch([run], S)
    assert "--init_from resume" in capsys.readouterr().out and "at step 2" in run.log.read_text()
    assert ex.run_state(run) == "done"
    assert [s for s, _ in ex.read_val_curve(run.out_dir)] == [0, 2, 4]
    ex.launch([run], S)
    assert "1 of 1 runs already finished" in capsys.readouterr().out
