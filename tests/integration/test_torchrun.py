"""`torchrun --nproc_per_node 2 -m vldist.train vsrn`: one process group, same steps, similar recall."""

import json
import subprocess
import sys

import pytest

JOB = [
    "model.embed_size=64",
    "model.decoder_hidden=64",
    "model.word_dim=32",
    "data.batch_size=32",
    "data.shuffle_buffer=100",
    "data.eval_batch_size=64",
    "train.epochs=6",
    "train.lr=0.001",
    "engine.sync_batchnorm=true",
]


def _run(launcher, shards, out, *extra):
    cmd = [*launcher, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}", *JOB, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr  # the gloo abort at interpreter exit
    return json.loads((out / "metrics.json").read_text()), proc


@pytest.fixture(scope="module")
def runs(planted_shards, tmp_path_factory):
    one, _ = _run([sys.executable], planted_shards, tmp_path_factory.mktemp("one"))
    two, proc = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        planted_shards,
        tmp_path_factory.mktemp("two"),
    )
    return one, two, proc


def test_two_ranks_form_one_group_and_take_the_same_steps(runs):
    one, two, proc = runs
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert two["steps"] == one["steps"] == 6 * 7
    assert two["samples_seen"] == one["samples_seen"] == 6 * 7 * 32
    assert sum(line.startswith("trained ") for line in proc.stdout.splitlines()) == 1  # rank 0 prints alone


def test_two_ranks_learn_as_well_as_one(runs):
    one, two, _ = runs
    untrained = one["untrained"]["full"]["rsum"]
    # different data order (seeded per rank) makes the runs differ, but both learn
    assert two["test"]["full"]["rsum"] > untrained + 100
    assert abs(two["test"]["full"]["rsum"] - one["test"]["full"]["rsum"]) < 100


@pytest.mark.parametrize("accumulation", [1, 2])
def test_exact_epochs_on_two_ranks_see_every_sample_once(planted_shards, tmp_path, accumulation):
    """200 samples, global batch 32: 6 full steps and one of 8 rows per epoch. With 2 micro-batches
    of 16 per step, the last step has a single micro-batch of 8 rows."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    metrics, _ = _run(
        launcher,
        planted_shards,
        tmp_path,
        "data.resampled=false",
        "train.epochs=2",
        f"train.grad_accumulation={accumulation}",
    )
    assert metrics["world_size"] == 2
    assert metrics["steps"] == 2 * 7
    assert metrics["samples_seen"] == 2 * 200
