"""ShardSetWriter: tar layout, round trips through tarfile and WebDataset, rollover, manifest."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from vldist.shards.format.layout import MANIFEST_NAME
from vldist.shards.format.writer import ShardSetWriter


def _jpeg(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _samples(n: int, prefix: str = "train") -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "__key__": f"{prefix}-{i:07d}",
            "jpg": _jpeg(i),
            "json": {"id": f"{prefix}-{i:07d}", "captions": [f"caption {i}", "é ünïcode"], "n": i},
            "regions.npy": rng.standard_normal((i % 4 + 1, 8)).astype(np.float16),
            "txt": f"text {i}",
            "cls": i,
        }
        for i in range(n)
    ]


def _write(out, samples, shard_size=1000, split="train"):
    with ShardSetWriter(out, shard_size=shard_size, source="test") as writer:
        for sample in samples:
            writer.write(split, sample)
        return writer.close(extra={"features": {"dim": 8}})


def test_tar_members_are_deterministic_contiguous_and_sorted(tmp_path):
    _write(tmp_path, _samples(3))
    with tarfile.open(tmp_path / "train-000000.tar") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    expected = [f"train-{i:07d}.{ext}" for i in range(3) for ext in ("cls", "jpg", "json", "regions.npy", "txt")]
    assert names == expected
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o444)
        assert m.isfile()


def test_round_trip_with_tarfile_and_webdataset(tmp_path):
    samples = _samples(5)
    _write(tmp_path, samples)
    shard = str(tmp_path / "train-000000.tar")

    with tarfile.open(shard) as tar:
        raw = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for s in samples:
        key = s["__key__"]
        assert raw[f"{key}.jpg"] == s["jpg"]
        assert json.loads(raw[f"{key}.json"].decode("utf-8")) == s["json"]
        np.testing.assert_array_equal(np.load(io.BytesIO(raw[f"{key}.regions.npy"])), s["regions.npy"])
        assert raw[f"{key}.txt"] == s["txt"].encode()
        assert raw[f"{key}.cls"] == str(s["cls"]).encode()

    read = list(wds.WebDataset(shard, shardshuffle=False))
    assert [r["__key__"] for r in read] == [s["__key__"] for s in samples]
    for r, s in zip(read, samples, strict=True):
        assert set(r) >= {"jpg", "json", "regions.npy", "txt", "cls"}
        assert r["jpg"] == s["jpg"]
        assert json.loads(r["json"]) == s["json"]
        arr = np.load(io.BytesIO(r["regions.npy"]))
        assert arr.dtype == np.float16 and arr.shape == s["regions.npy"].shape
        np.testing.assert_array_equal(arr, s["regions.npy"])
    decoded = next(iter(wds.WebDataset(shard, shardshuffle=False).decode("rgb")))
    assert decoded["jpg"].shape == (16, 16, 3)


def test_rollover_and_manifest(tmp_path):
    manifest = _write(tmp_path, _samples(7), shard_size=3)
    files = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".idx.json"))
    assert {p.name for p in tmp_path.glob("*.idx.json")} == {f"{n}.idx.json" for n in files if n.endswith(".tar")}
    assert files == [MANIFEST_NAME, "train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert manifest == json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert (manifest["format"], manifest["version"], manifest["source"]) == ("vldist-shards", 1, "test")
    assert manifest["features"] == {"dim": 8}
    split = manifest["splits"]["train"]
    assert split["samples"] == 7
    assert [s["samples"] for s in split["shards"]] == [3, 3, 1]
    for entry in split["shards"]:
        path = tmp_path / entry["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        with tarfile.open(path) as tar:
            assert len(tar.getmembers()) == entry["samples"] * 5


def test_splits_get_their_own_shards(tmp_path):
    with ShardSetWriter(tmp_path, shard_size=2) as writer:
        for i, sample in enumerate(_samples(5)):
            writer.write("train" if i % 2 else "val", sample)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())  # written by a normal `with` exit
    assert {k: v["samples"] for k, v in manifest["splits"].items()} == {"train": 2, "val": 3}
    assert [s["file"] for s in manifest["splits"]["val"]["shards"]] == ["val-000000.tar", "val-000001.tar"]


def test_same_input_gives_identical_bytes(tmp_path):
    a = _write(tmp_path / "a", _samples(4), shard_size=3)
    b = _write(tmp_path / "b", _samples(4), shard_size=3)
    assert a == b
    for name in ("train-000000.tar", "train-000001.tar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_open_shard_has_only_a_tmp_name_and_failure_leaves_no_manifest(tmp_path):
    with pytest.raises(KeyError):
        with ShardSetWriter(tmp_path, shard_size=10) as writer:
            writer.write("train", _samples(1)[0])
            assert (tmp_path / "train-000000.tar.tmp").exists()
            assert not (tmp_path / "train-000000.tar").exists()
            raise KeyError("simulated failure")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["a.b", "dir/x", "", None])
def test_bad_keys_are_refused(tmp_path, key):
    with ShardSetWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="key"):
            writer.write("train", {"__key__": key, "txt": "x"})


def test_duplicate_key_and_bad_values_are_refused(tmp_path):
    with ShardSetWriter(tmp_path) as writer:
        writer.write("train", {"__key__": "k1", "txt": "x"})
        with pytest.raises(ValueError, match="duplicate"):
            writer.write("val", {"__key__": "k1", "txt": "y"})
        with pytest.raises(TypeError, match="cannot store"):
            writer.write("train", {"__key__": "k2", "obj": object()})
        writer.close()
        with pytest.raises(RuntimeError, match="closed"):
            writer.write("train", {"__key__": "k3", "txt": "z"})
