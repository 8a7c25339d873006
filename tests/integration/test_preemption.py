"""Stop signals lose no work: 2 ranks under torchrun finish their step, checkpoint it and exit 75;
the resumed run ends with the uninterrupted run's weights to the bit."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
from helpers import (
    PREEMPT_EPOCH_STEPS,
    PREEMPT_JOB,
    PREEMPT_STEPS,
    TORCHRUN,
    assert_same_weights,
    stop_event,
    wait_for_step,
    weights,
)

from vldist.checkpoint.format import step_checkpoints, verify
from vldist.exit_codes import STOPPED as EXIT_STOPPED


def _torchrun(shards, out, *extra):
    cmd = [*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}", *PREEMPT_JOB, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The ranks torchrun started (its children; loader workers are the ranks' children), by RANK."""
    return {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}


def test_sigterm_to_torchrun_checkpoints_the_step_reached_and_the_resumed_run_ends_identical(
    planted_shards, tmp_path, two_rank_reference
):
    out = tmp_path / "stopped"
    launcher = _torchrun(planted_shards, out)
    wait_for_step(out, 5, launcher)
    ranks = _rank_processes(launcher)
    assert sorted(ranks) == [0, 1]
    os.kill(launcher.pid, signal.SIGTERM)  # as `kill`, scancel or Kubernetes would: torchrun relays it
    time.sleep(0.1)
    os.kill(launcher.pid, signal.SIGTERM)  # a second signal while the ranks stop and save
    log, _ = launcher.communicate(timeout=120)
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in ranks.values())

    stop = stop_event(out)
    step = stop["step"]
    assert stop["reason"] == "SIGTERM"
    assert log.count("SIGTERM received: finishing this step") == 2  # each rank took it
    assert "stopped by SIGTERM after step" in log
    # the checkpoint is of the step reached, mid-epoch: no periodic checkpoint falls there
    assert 5 <= step < PREEMPT_EPOCH_STEPS
    assert [p.name for p in step_checkpoints(out / "checkpoints")] == [f"step-{step:08d}"]
    verify(out / "checkpoints" / f"step-{step:08d}")
    assert not (out / "metrics.json").exists()

    resumed = _torchrun(planted_shards, out, "train.resume=auto")
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{step:08d}'}" in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 1
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(out / "checkpoints" / final), weights(two_rank_reference / "checkpoints" / final))
    reference = json.loads((two_rank_reference / "metrics.json").read_text())
    assert metrics["test"]["full"] == reference["test"]["full"]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(planted_shards, tmp_path):
    out = tmp_path / "one-rank"
    launcher = _torchrun(planted_shards, out)
    wait_for_step(out, 3, launcher)
    ranks = _rank_processes(launcher)
    ranks[1].send_signal(signal.SIGUSR1)  # rank 1 alone (no process group): rank 0 learns it in the step's all-reduce
    log, _ = launcher.communicate(timeout=120)  # a rank waiting forever would time out here
    assert log.count("SIGUSR1 received") == 1
    step = stop_event(out)["step"]
    assert "stopped by SIGUSR1 after step" in log
    verify(out / "checkpoints" / f"step-{step:08d}")
    # both ranks exit with the documented code, rank 0 too when torchrun signals it after rank 1 left
    assert log.count(f"exitcode  : {EXIT_STOPPED} ") == 2, log[-3000:]


def test_a_single_process_stops_with_exit_75(planted_shards, tmp_path):
    out = tmp_path / "single"
    cmd = [
        sys.executable,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        *PREEMPT_JOB,
        "engine.sync_batchnorm=false",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGTERM)  # the process alone, as Kubernetes signals a container's first process
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, log[-3000:]
    step = stop_event(out)["step"]
    assert f"checkpoint {out / 'checkpoints' / f'step-{step:08d}'}" in log
    assert "train.resume=auto" in log and "Traceback" not in log
