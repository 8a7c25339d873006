"""Training and evaluation from a real S3 store (SeaweedFS on 127.0.0.1, tests/seaweed.py), the
credentials only in the environment as a cluster node has them: the same metrics as from disk, no
secret in any output, and a wrong bucket or wrong credentials refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import SMALL_VSRN


@pytest.fixture(scope="module")
def s3_set(s3_store, planted_shards):
    """The planted set uploaded to s3://vldist-tests/planted."""
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(planted_shards), "vldist-tests/planted", recursive=True)
    return "s3://vldist-tests/planted"


def _train(shards, out, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}",
                           "train.epochs=1", "data.workers=2", *SMALL_VSRN, *extra], capture_output=True, text=True,
                          timeout=300, env=env)


def test_a_job_trains_and_evaluates_from_s3_as_from_disk_and_writes_no_secret(s3_store, s3_set, planted_shards,
                                                                               tmp_path):
    runs = {}
    for name, shards in (("local", planted_shards), ("s3", s3_set)):
        done = _train(shards, tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = (json.loads((tmp_path / name / "metrics.json").read_text()), done.stdout + done.stderr)
    assert runs["s3"][0]["test"] == runs["local"][0]["test"]
    evaluated = {}
    for name, shards in (("local", planted_shards), ("s3", s3_set)):  # the local run's checkpoint on either set
        done = subprocess.run([sys.executable, "-m", "vldist.evaluate", str(tmp_path / "local"), "--shards",
                               str(shards), "--json"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated[name] = done
    metrics = {name: json.loads(done.stdout[done.stdout.index("\n{") + 1:]) for name, done in evaluated.items()}
    assert metrics["s3"] == metrics["local"] and metrics["s3"]["n_images"] > 0
    evaluated = evaluated["s3"]
    # the secret is in the environment only: in no output, no file of the run (config, metrics, checkpoints)
    secret = s3_store.secret_key.encode()
    assert secret.decode() not in runs["s3"][1] + evaluated.stdout + evaluated.stderr
    leaked = [p for p in (tmp_path / "s3").rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert leaked == []


def test_a_missing_bucket_or_wrong_credentials_are_refused_in_one_line(s3_store, s3_set, tmp_path):
    import os

    done = _train("s3://no-such-bucket/planted", tmp_path / "a")
    assert done.returncode == 2 and "error: shard directory 's3://no-such-bucket/planted' does not exist" in done.stderr
    wrong = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret-" + "x" * 20}
    done = _train(s3_set, tmp_path / "b", env=wrong)
    assert done.returncode == 2 and f"error: cannot read {s3_set}: " in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "not-the-secret" not in done.stderr


def test_two_ranks_under_torchrun_read_the_store_as_the_disk(s3_set, planted_shards, tmp_path):
    from helpers import TORCHRUN

    results = {}
    for name, shards in (("local", planted_shards), ("s3", s3_set)):
        out = tmp_path / name
        done = subprocess.run([*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}",
                               "train.epochs=1", *SMALL_VSRN], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "x 2), output in" in done.stderr  # two ranks, each reading the shards itself
        results[name] = json.loads((out / "metrics.json").read_text())
    assert results["s3"]["test"] == results["local"]["test"]
