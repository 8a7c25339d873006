"""engine.backend=deepspeed on 2 gloo processes: the VSRN job under ZeRO 2 and 3 trains, saves sharded state
and resumes (ZeRO 1: below).

Real DeepSpeed (`deepspeed.initialize`), real torchrun. A run resumed from its step-5 checkpoint
must end with the weights of the uninterrupted run; a damaged optimizer shard of one rank must
make both ranks fall back to the previous checkpoint together.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from vldist.export import export

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "train.epochs=2",
    "train.save_every_steps=5",
    "train.keep_last=3",
    "eval.baseline=false",
    "engine.sync_batchnorm=true",
    "engine.backend=deepspeed",
]


def _train(shards, out, stage, *extra):
    cmd = [
        *TORCHRUN,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={shards}",
        f"output.dir={out}",
        *JOB,
        f"engine.deepspeed_config=jobs/deepspeed/zero{stage}.json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    return proc.stderr


def _without_launcher() -> dict:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }


def _weights(out, step):
    return load_file(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


# ZeRO-1 runs DeepSpeed's optimizer class of ZeRO-2 (stage_1_and_2.py) and writes the same
# checkpoint files; its step and its exact resume on 1, 2 and 3 ranks are proven in
# test_distributed_equivalence.py and test_resharding.py, so the job's own run covers stages 2 and 3
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_trains_saves_shards_and_resumes_exactly(planted_shards, tmp_path, stage):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _train(planted_shards, whole, stage, "train.keep_last=4")  # steps 5, 7 (the epoch's end), 10 and 14
    metrics = json.loads((whole / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 14
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]

    shards = sorted(p.name for p in (whole / "checkpoints" / "step-00000014" / "deepspeed" / "zero").glob("*.pt"))
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards  # one optimizer shard per rank

    # the run as a stop after step 5, mid-epoch, leaves it: its checkpoints up to step 5, nothing later
    shutil.copytree(whole, parts)
    for later in ("step-00000007", "step-00000010", "step-00000014", "best"):
        shutil.rmtree(parts / "checkpoints" / later)
    log = _train(planted_shards, parts, stage, "train.resume=latest")
    assert "resumed from" in log and "step-00000005" in log
    expected, got = _weights(whole, 14), _weights(parts, 14)
    for name, tensor in expected.items():
        assert (got[name] == tensor).all(), name
    resumed = json.loads((parts / "metrics.json").read_text())
    assert resumed["steps"] == 14 and resumed["restarts"] == 1
    if stage == 3:  # on this run's checkpoints: one rank's damaged shard makes every rank fall back
        shard = (
            whole / "checkpoints" / "step-00000014" / "deepspeed" / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        )
        shard.write_bytes(shard.read_bytes()[:500])
        log = _train(planted_shards, whole, stage, "train.resume=latest")
        assert "cannot resume from" in log and "zero_pp_rank_1" in log and "damaged" in log
        assert "resumed from" in log and "step-00000010" in log  # the checkpoint before it
        assert json.loads((whole / "metrics.json").read_text())["steps"] == 14
        again = _weights(whole, 14)
        assert all((again[name] == tensor).all() for name, tensor in expected.items())  # exact from there too


def test_one_plain_process_trains_under_deepspeed(planted_shards, tmp_path):
    """`python -m vldist.train ... engine.backend=deepspeed` with no launcher, as on one GPU: a world
    of one (RANK/WORLD_SIZE/MASTER_* filled in), not DeepSpeed's MPI discovery (mpi4py)."""
    env = _without_launcher()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={tmp_path / 'run'}",
            *JOB,
            "train.epochs=1",
            "metrics.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "mpi4py" not in proc.stderr and "Traceback" not in proc.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["config"]["engine"]["backend"] == "deepspeed"
    assert metrics["steps"] == 7  # 200 training rows of the planted set in batches of 32


def test_a_two_rank_zero_checkpoint_resumes_in_one_plain_process(planted_shards, tmp_path):
    """2 -> 1 through vldist.train: DeepSpeed's shards of 2 ranks converted on resume (its universal
    checkpoint), training carries on from step 5 to the end. (That the moments and the loss curve
    carry over exactly, for every stage and engine: test_resharding.py; a world that cannot split
    the global batch: tests/unit/test_training_setup.py.)"""
    out = tmp_path / "run"
    _train(planted_shards, out, 2, "train.max_steps=5", "train.log_every=1")
    export(out, tmp_path / "export", "step-5")  # the ZeRO checkpoint of 2 ranks, as whole weights
    exported, saved = load_file(tmp_path / "export" / "model.safetensors"), _weights(out, 5)
    assert exported.keys() == saved.keys() and all((exported[k] == v).all() for k, v in saved.items())

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            *JOB,
            "engine.deepspeed_config=jobs/deepspeed/zero2.json",
            "train.resume=latest",
            "train.log_every=1",
            "metrics.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_without_launcher(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step-00000005" in proc.stderr and "written by 2 ranks, resumed on 1" in proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["steps"] == 14 and metrics["restarts"] == 1
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in steps if r.get("event") == "train"]
    assert steps == list(range(1, 15))  # steps 1-5 on 2 ranks, 6-14 on one: none repeated, none lost
