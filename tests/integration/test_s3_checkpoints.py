"""Checkpoints in a real S3 store (SeaweedFS on 127.0.0.1, tests/seaweed.py), `output.checkpoint_dir`:
uploaded COMPLETE last; a run whose local disk is gone resumes from the store to the weights of an
uninterrupted run; an upload cut short is never loaded; `vldist.evaluate` and `vldist.export` read
the store; the secret key is written nowhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import pytest
import torch
from helpers import SMALL_VSRN
from safetensors.torch import load_file

from vldist.checkpoint.format import MARKER


@pytest.fixture(autouse=True)
def store_credentials(s3_store, monkeypatch, tmp_path):
    """The store's credentials in the environment, as a cluster node has them; downloads for
    evaluation and export cached under this test's directory."""
    for name, value in s3_store.environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def prefix(s3_store) -> str:
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    return f"vldist-tests/checkpoints-{uuid.uuid4().hex[:8]}"


def _stored(fs, prefix) -> list[str]:
    """The checkpoints with objects under `prefix` (SeaweedFS keeps a prefix's empty directory entry
    after its objects are deleted; S3 has none: objects are what counts)."""
    return sorted({path[len(prefix) + 1 :].split("/", 1)[0] for path in fs.find(prefix) if path != prefix})


def _train(shards, out, url, *extra):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={shards}",
            f"output.dir={out}",
            "train.epochs=1",
            *SMALL_VSRN,
            "train.save_every_steps=3",
            f"output.checkpoint_dir={url}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_run_resumes_from_the_store_when_its_disk_is_gone(s3_store, planted_shards, trained_vsrn, prefix, tmp_path):
    fs, url, out = s3_store.filesystem(), f"s3://{prefix}", tmp_path / "run"
    logs = _train(planted_shards, out, url, "train.max_steps=5")
    assert _stored(fs, prefix) == ["best", "step-00000003", "step-00000005"]
    for name in ("step-00000005", "best"):
        local = out / "checkpoints" / name
        stored = {p.split(f"{name}/", 1)[1] for p in fs.find(f"{prefix}/{name}")}
        assert stored == {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}

    shutil.rmtree(out)  # another machine: nothing of the run on its disk
    logs += _train(planted_shards, out, url, "train.resume=latest")
    assert "resumed from" in logs and "step-00000005" in logs
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 7 and metrics["restarts"] == 1
    expected = load_file(trained_vsrn / "checkpoints" / "step-00000007" / "model.safetensors")
    got = load_file(out / "checkpoints" / "step-00000007" / "model.safetensors")
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # as if never interrupted
    # keep_last=2 in the store as on disk (the resumed run saved steps 6 and 7)
    assert _stored(fs, prefix) == ["best", "step-00000006", "step-00000007"]

    # Evaluation and export from the store alone, and no secret anywhere.
    evaluated = subprocess.run(
        [sys.executable, "-m", "vldist.evaluate", url, "--json"], capture_output=True, text=True, timeout=300
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout[evaluated.stdout.index("\n{") + 1 :])["full"] == metrics["test"]["full"]
    exported = subprocess.run(
        [sys.executable, "-m", "vldist.export", url, "--checkpoint", "latest", "--out", str(tmp_path / "export")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exported.returncode == 0 and "step-00000007" in exported.stdout, exported.stderr[-3000:]
    assert all(torch.equal(load_file(tmp_path / "export" / "model.safetensors")[k], got[k]) for k in got)
    secret = s3_store.secret_key
    assert secret not in logs + evaluated.stdout + evaluated.stderr + exported.stdout + exported.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_run_killed_during_an_upload_resumes_from_the_checkpoint_before(s3_store, planted_shards, prefix, tmp_path):
    """The run reaches the store through a proxy that holds the upload of step 5's weights; the
    run is killed (SIGKILL, every process) while it waits, leaving step 5's other files in the store
    without COMPLETE. Resumed on another machine (no local disk), it takes step 3, never step 5, and
    prunes the leftover once a newer upload completes."""
    import os
    import signal

    from fault_proxy import FaultProxy

    fs, url, out = s3_store.filesystem(), f"s3://{prefix}", tmp_path / "run"
    with FaultProxy(s3_store.endpoint) as proxy:
        proxy.faults.hold = f"{prefix}/step-00000005/model.safetensors"
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vldist.train",
                "vsrn",
                f"data.shards={planted_shards}",
                f"output.dir={out}",
                "train.epochs=1",
                *SMALL_VSRN,
                "train.save_every_steps=3",
                f"output.checkpoint_dir={url}",
                "train.max_steps=5",
            ],
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.url},
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert proxy.faults.held.wait(240), "the run never uploaded step 5's weights"
        finally:
            os.killpg(run.pid, signal.SIGKILL)  # the run and its loader workers, as a lost machine
            run.wait(30)
    stored = {p.split(f"{prefix}/step-00000005/", 1)[1] for p in fs.find(f"{prefix}/step-00000005")}
    assert stored and MARKER not in stored and "model.safetensors" not in stored  # files before it, up; no COMPLETE
    assert (out / "checkpoints" / "step-00000005" / MARKER).is_file()  # committed locally before its upload
    shutil.rmtree(out)
    logs = _train(planted_shards, out, url, "train.resume=latest")
    assert (
        "resumed from" in logs
        and "step-00000003" in logs
        and "step-00000005" not in logs.split("resumed from")[1][:200]
    )
    assert json.loads((out / "metrics.json").read_text())["steps"] == 7
    assert "step-00000005" not in _stored(fs, prefix)  # the leftover pruned once a newer upload completed
