"""A run killed with SIGKILL and resumed ends where an uninterrupted run ends, to the bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "train.epochs=3",
    "train.save_every_steps=4",
    "train.keep_last=3",
    "eval.baseline=false",
]


def _train(shards, out, *extra, wait=True):
    cmd = [sys.executable, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}", *JOB, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if wait:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        return err
    return proc


def _final_weights(out):
    steps = sorted((out / "checkpoints").glob("step-*"))
    return load_file(steps[-1] / "model.safetensors"), steps[-1].name


@pytest.fixture(scope="module")
def uninterrupted(planted_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    _train(planted_shards, out)
    return out


SHARDED_ASYNC = ("train.checkpoint_format=sharded", "train.async_checkpoints=true")


@pytest.mark.parametrize("checkpoints", [(), SHARDED_ASYNC], ids=["plain", "sharded-async"])
def test_killed_run_resumes_to_identical_weights(planted_shards, tmp_path, uninterrupted, checkpoints):
    """Also with sharded checkpoints written in the background: the run's weights are those of the
    uninterrupted plain run, to the bit (saving changes nothing of training, and the background
    write saves the state of its step, not a later one); its periodic checkpoints hold no whole
    weights, its best and final do, and a periodic one evaluates and exports from DCP's files."""
    out = tmp_path / "killed"
    proc = _train(planted_shards, out, *checkpoints, wait=False)
    marker = out / "checkpoints" / "step-00000012" / "COMPLETE"  # mid epoch 2 (7 steps an epoch)
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its loader workers, with no chance to clean up
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "metrics.json").exists()

    log = _train(planted_shards, out, *checkpoints, "train.resume=latest")
    assert "resumed from" in log

    expected, expected_name = _final_weights(uninterrupted)
    got, got_name = _final_weights(out)
    assert got_name == expected_name == "step-00000021"
    for name, tensor in expected.items():
        assert (got[name] == tensor).all(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 21 and metrics["restarts"] == 1
    if checkpoints:  # sharded: periodic checkpoints without whole weights, best and final with them
        _sharded_checkpoints_keep_whole_weights_for_best_and_final_and_still_evaluate(out, uninterrupted, tmp_path)
    whole = json.loads((uninterrupted / "metrics.json").read_text())
    assert metrics["test"]["full"] == whole["test"]["full"]
    assert [h["train_loss"] for h in metrics["history"]] == [h["train_loss"] for h in whole["history"]]


def _sharded_checkpoints_keep_whole_weights_for_best_and_final_and_still_evaluate(out, uninterrupted, tmp_path):
    from vldist.checkpoint.format import load_model_state
    from vldist.evaluate import evaluate_checkpoint
    from vldist.export import export

    checkpoints = out / "checkpoints"
    periodic, final = checkpoints / "step-00000020", checkpoints / "step-00000021"
    assert (periodic / "sharded" / ".metadata").is_file() and not (periodic / "model.safetensors").exists()
    assert (final / "model.safetensors").is_file() and (checkpoints / "best" / "model.safetensors").is_file()
    assert not (final / "optimizer.pt").exists()  # the optimizer is in the sharded files
    # A periodic checkpoint's weights come from DCP's files, in one process with no process group.
    plain_periodic = load_file(uninterrupted / "checkpoints" / "step-00000020" / "model.safetensors")
    from_shards = load_model_state(periodic)
    assert from_shards.keys() == plain_periodic.keys()
    assert all(torch.equal(from_shards[k], plain_periodic[k]) for k in plain_periodic)
    _, metrics = evaluate_checkpoint(periodic, device="cpu")
    assert metrics["full"]["rsum"] > 0
    # and an export of it holds those weights as safetensors
    export(out, tmp_path / "export", "step-20")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[k], plain_periodic[k]) for k in plain_periodic)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(planted_shards, tmp_path, uninterrupted):
    out = tmp_path / "damaged"
    _train(planted_shards, out, "train.max_steps=12")
    newest = out / "checkpoints" / "step-00000012" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as a full disk might leave it
    log = _train(planted_shards, out, "train.resume=latest")
    assert "cannot resume from" in log and "step-00000012" in log and "damaged" in log
    assert "resumed from" in log and "step-00000008" in log
    expected, _ = _final_weights(uninterrupted)
    got, _ = _final_weights(out)
    assert all((got[n] == t).all() for n, t in expected.items())


def test_resume_latest_without_checkpoints_is_an_error_and_auto_starts_fresh(planted_shards, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={tmp_path}",
            *JOB,
            "train.resume=latest",
            "train.max_steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "no usable checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    err = _train(planted_shards, tmp_path, "train.resume=auto", "train.max_steps=2")
    assert "starting fresh" in err
