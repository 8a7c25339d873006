"""`python -m vldist.shards verify`: every problem is found and named by shard and key."""

import json
import subprocess
import sys

import numpy as np
from helpers import npy_bytes, write_planted_shards, write_tar

from vldist.shards.format.verify import verify


def test_an_intact_set_passes(tmp_path):
    report = verify(write_planted_shards(tmp_path / "s"))
    assert report.ok, report.problems
    assert dict(report.samples) == {"train": 200, "val": 40, "test": 60}


def test_damage_is_reported_by_shard_and_key(tmp_path):
    shards = write_planted_shards(tmp_path / "s")
    truncated = shards / "train-000000.tar"
    truncated.write_bytes(truncated.read_bytes()[:3000])
    (shards / "val-000000.tar").unlink()
    good = json.dumps({"captions": ["a red circle"]}).encode()
    write_tar(
        shards / "train-000001.tar",
        {
            "bad-json.json": b"{not json",
            "bad-json.regions.npy": npy_bytes(np.ones((3, 32), np.float32)),
            "nan.json": good,
            "nan.regions.npy": npy_bytes(np.full((3, 32), np.nan, np.float32)),
            "wide.json": good,
            "wide.regions.npy": npy_bytes(np.ones((3, 7), np.float32)),
            "nocap.json": json.dumps({"captions": []}).encode(),
            "test-0000001.json": good,  # a key the test split uses too
            "pair.json": good,
            "pair.img1.jpg": b"\xff\xd8 not a jpeg",  # a pair sample's named members
            "pair.img2.regions.npy": npy_bytes(np.full((3, 32), np.inf, np.float32)),
        },
    )
    problems = "\n".join(verify(shards).problems)
    assert "train-000000.tar: sha256 differs" in problems
    assert "train-000000.tar: unreadable tar" in problems
    assert "val-000000.tar: listed in manifest.json but missing" in problems
    assert "train-000001.tar bad-json: json does not decode" in problems
    assert "train-000001.tar nan: regions.npy holds NaN or inf" in problems
    assert "train-000001.tar wide: regions.npy has 7 features, the manifest says 32" in problems
    assert "train-000001.tar nocap: json has no non-empty 'captions'" in problems
    assert "train-000001.tar pair: img1.jpg does not decode" in problems
    assert "train-000001.tar pair: regions.npy holds NaN or inf" in problems
    assert "train-000001.tar: holds 6 samples, manifest.json says 50" in problems
    assert "test-0000001: key appears in 2 samples" in problems


def test_the_command_exits_non_zero_and_prints_the_problems(tmp_path):
    shards = write_planted_shards(tmp_path / "s")
    (shards / "test-000000.tar").write_bytes(b"")
    proc = subprocess.run(
        [sys.executable, "-m", "vldist.shards", "verify", str(shards)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "problem: test-000000.tar" in proc.stdout and "problems" in proc.stdout.splitlines()[-1]
    ok = subprocess.run(
        [sys.executable, "-m", "vldist.shards", "verify", str(write_planted_shards(tmp_path / "t"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout.strip().endswith(")") and "; ok (" in ok.stdout
