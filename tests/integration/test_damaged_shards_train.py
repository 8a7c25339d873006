"""Training on a set with a shard cut short, through the command line, from disk and from a real S3
store (SeaweedFS): in an exact epoch and a resampled one the run skips and counts what the shard
lacks and ends (it used to loop on the short epoch until the hang watchdog); past
data.max_skipped_fraction it stops in one line naming the shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import CUT_SHARD, SMALL_VSRN, TORCHRUN, cut_shard_copy


def _cut_at_the_40th_sample(shard, ends):
    return ends[39]  # 10 of the shard's 50 samples lost: 10 of the set's 200


LOST = 10


@pytest.fixture(scope="module")
def cut_set(planted_shards, tmp_path_factory):
    shards, whole = cut_shard_copy(planted_shards, tmp_path_factory.mktemp("cut") / "set", _cut_at_the_40th_sample)
    assert 50 - whole == LOST
    return shards


def _train(shards, out, *extra, launcher=(sys.executable,), env=None):
    return subprocess.run(
        [
            *launcher,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={shards}",
            f"output.dir={out}",
            "data.workers=2",
            *SMALL_VSRN,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,  # a run that loops on its short epoch fails here, not at the hang watchdog
        env=env,
    )


def _check_counted(done, out, epochs: int, exact: bool) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    [(shard, count)] = metrics["skipped_by_shard"].items()
    assert shard.endswith(CUT_SHARD)
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, epochs + 1))
    if exact:  # every sample the shard lacks, once per epoch, whatever the ranks and workers
        assert metrics["skipped_samples"] == count == LOST * epochs
        assert [h["skipped_samples"] for h in metrics["history"]] == [LOST] * epochs
        assert metrics["samples_seen"] == (200 - LOST) * epochs
    else:  # resampled: counted each time the cut shard is drawn
        assert metrics["skipped_samples"] == count and count % LOST == 0 and count > 0
    assert "holds 40 of the 50 samples its manifest lists" in done.stderr
    return metrics


def test_an_exact_epoch_and_a_resampled_one_over_a_cut_shard_skip_count_and_end(cut_set, tmp_path):
    exact = _train(cut_set, tmp_path / "exact", "data.resampled=false", "train.epochs=2")
    metrics = _check_counted(exact, tmp_path / "exact", epochs=2, exact=True)
    assert metrics["steps"] == 2 * 6  # 190 samples an epoch in batches of 32: 6 of the 7 steps planned
    assert "it ended after 6 of its 7 steps" in exact.stderr
    resampled = _train(cut_set, tmp_path / "resampled", "train.epochs=2")
    assert _check_counted(resampled, tmp_path / "resampled", epochs=2, exact=False)["steps"] == 2 * 7


def test_two_ranks_end_an_exact_epoch_over_a_cut_shard_at_the_same_step(cut_set, tmp_path):
    done = _train(cut_set, tmp_path / "two", "data.resampled=false", "train.epochs=1", launcher=TORCHRUN)
    metrics = _check_counted(done, tmp_path / "two", epochs=1, exact=True)
    assert metrics["world_size"] == 2 and metrics["steps"] == 6


def test_past_max_skipped_fraction_the_run_stops_in_one_line_naming_the_shard(cut_set, tmp_path):
    done = _train(cut_set, tmp_path / "bound", "data.resampled=false", "data.max_skipped_fraction=0.04")
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "10 of the 200 samples of epoch 1 were unreadable and skipped" in line
    assert "data.max_skipped_fraction=0.04" in line and f"{CUT_SHARD} (10)" in line
    assert f"python -m vldist.shards verify {cut_set}" in line
    assert "Traceback" not in done.stderr


def test_a_cut_shard_in_the_store_is_skipped_and_counted_as_on_disk(s3_store, cut_set, tmp_path):
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(cut_set), "vldist-tests/cut", recursive=True)
    env = {**os.environ, **s3_store.environment}
    for mode, extra in (("exact", ["data.resampled=false"]), ("resampled", [])):
        done = _train("s3://vldist-tests/cut", tmp_path / mode, "train.epochs=1", *extra, env=env)
        _check_counted(done, tmp_path / mode, epochs=1, exact=mode == "exact")
