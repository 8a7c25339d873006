"""A conversion killed mid-way (SIGKILL, main process and workers) resumes where it stopped: finished
shards are kept, the half-written one is redone, and the result is byte-identical to a conversion
that was never interrupted, without a duplicated sample.

The kill lands at a known point: one test image is a named pipe, so the worker that reaches it
blocks until the test has killed everything; the pipe is then replaced by the real image."""

import os
import signal
import subprocess
import sys
import time

from dataset_fixtures import make_karpathy

from vldist.shards.format.verify import verify


def _command(src, images, out):
    return [
        sys.executable,
        "-m",
        "vldist.shards",
        "convert",
        "karpathy",
        "--src",
        str(src),
        "--images",
        str(images),
        "--out",
        str(out),
        "--shard-size",
        "2",
        "--workers",
        "2",
        "--feature-size",
        "64",
        "--region-grid",
        "2",
        "--quiet",
    ]


def test_killed_conversion_resumes_without_duplicates(tmp_path):
    expected = make_karpathy(tmp_path / "coco", {"train": 8, "val": 2, "test": 5})
    src, images = tmp_path / "coco" / "dataset_coco.json", tmp_path / "coco" / "images"
    blocked = [e for e in expected if e["split"] == "test"][3]["path"]  # in test shard 1 of 3
    real_bytes = blocked.read_bytes()
    blocked.unlink()
    os.mkfifo(blocked)

    out = tmp_path / "out"
    process = subprocess.Popen(
        _command(src, images, out), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    done = out / ".convert" / "done"
    total_shards = 4 + 1 + 3
    deadline = time.monotonic() + 120
    while len(list(done.glob("*.json"))) < total_shards - 1:  # all but the blocked one
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "conversion did not reach the blocked image"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "manifest.json").exists() and (out / "test-000001.tar.tmp").exists()

    blocked.unlink()
    blocked.write_bytes(real_bytes)
    resumed = subprocess.run(_command(src, images, out), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{total_shards - 1} shards kept from an earlier run" in resumed.stdout
    report = verify(out)
    assert report.ok, report.problems  # includes: every key once across the set
    assert dict(report.samples) == {"train": 8, "val": 2, "test": 5}

    clean = tmp_path / "clean"
    subprocess.run(_command(src, images, clean), check=True, capture_output=True, timeout=300)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in clean.iterdir()}
