"""Training and evaluation from a real S3 store (SeaweedFS on 127.0.0.1, tests/seaweed.py), the
credentials only in the environment as a cluster node has them: the same metrics as from disk, no
secret in any output, and a wrong bucket or wrong credentials refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SMALL_VSRN


@pytest.fixture(autouse=True)
def store_credentials(s3_store, monkeypatch):
    """The store's credentials in the environment during each test here, as a cluster node has
    them: jobs started here (and their subprocesses) find them where s3fs looks."""
    for name, value in s3_store.environment.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def s3_set(s3_store, planted_shards):
    """The planted set uploaded to s3://vldist-tests/planted."""
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(planted_shards), "vldist-tests/planted", recursive=True)
    return "s3://vldist-tests/planted"


def _train(shards, out, *extra, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={shards}",
            f"output.dir={out}",
            "train.epochs=1",
            "data.workers=2",
            *SMALL_VSRN,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_job_trains_and_evaluates_from_s3_as_from_disk_and_writes_no_secret(
    s3_store, s3_set, planted_shards, tmp_path
):
    runs = {}
    for name, shards in (("local", planted_shards), ("s3", s3_set)):
        done = _train(shards, tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = (json.loads((tmp_path / name / "metrics.json").read_text()), done.stdout + done.stderr)
    assert runs["s3"][0]["test"] == runs["local"][0]["test"]
    evaluated = {}
    for name, shards in (("local", planted_shards), ("s3", s3_set)):  # the local run's checkpoint on either set
        done = subprocess.run(
            [sys.executable, "-m", "vldist.evaluate", str(tmp_path / "local"), "--shards", str(shards), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated[name] = done
    metrics = {name: json.loads(done.stdout[done.stdout.index("\n{") + 1 :]) for name, done in evaluated.items()}
    assert metrics["s3"] == metrics["local"] and metrics["s3"]["n_images"] > 0
    evaluated = evaluated["s3"]
    # the secret is in the environment only: in no output, no file of the run (config, metrics, checkpoints)
    secret = s3_store.secret_key.encode()
    assert secret.decode() not in runs["s3"][1] + evaluated.stdout + evaluated.stderr
    leaked = [p for p in (tmp_path / "s3").rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert leaked == []


def test_a_missing_bucket_or_wrong_or_missing_credentials_are_refused_in_one_line(s3_store, s3_set, tmp_path):
    import os

    done = _train("s3://no-such-bucket/planted", tmp_path / "a")
    assert done.returncode == 2 and "error: shard directory 's3://no-such-bucket/planted' does not exist" in done.stderr
    wrong = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret-" + "x" * 20}
    done = _train(s3_set, tmp_path / "b", env=wrong)
    assert done.returncode == 2 and f"error: cannot read {s3_set}: " in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "not-the-secret" not in done.stderr
    # no credentials at all (and no instance metadata to ask: the test's traffic stays on loopback)
    bare = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    done = _train(
        s3_set,
        tmp_path / "c",
        env={
            **bare,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
        },
    )
    assert done.returncode == 2 and f"error: cannot read {s3_set}: " in done.stderr, done.stderr[-2000:]
    assert "AWS_ACCESS_KEY_ID" in done.stderr and "Traceback" not in done.stderr


def test_two_ranks_under_torchrun_read_the_store_as_the_disk(s3_set, two_rank_reference, tmp_path):
    from helpers import PREEMPT_JOB, TORCHRUN

    out = tmp_path / "s3"
    done = subprocess.run(
        [*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={s3_set}", f"output.dir={out}", *PREEMPT_JOB],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x 2), output in" in done.stderr  # two ranks, each reading the shards itself
    reference = json.loads((two_rank_reference / "metrics.json").read_text())  # the same job from local disk
    assert json.loads((out / "metrics.json").read_text())["test"] == reference["test"]


def _shards_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "vldist.shards", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


SMALL_SYNTH = ["--train", "40", "--val", "10", "--test", "10", "--shard-size", "20", "--quiet"]


def test_synth_writes_to_the_store_as_to_disk_and_verify_checks_it_there(s3_store, tmp_path):
    import hashlib

    url = "s3://vldist-tests/synth-small"
    done = _shards_cli("synth", "--out", url, "--stage", tmp_path / "stage", *SMALL_SYNTH)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"published {url}" in done.stdout and not any((tmp_path / "stage").iterdir())  # staging removed
    local = tmp_path / "local"
    assert _shards_cli("synth", "--out", local, *SMALL_SYNTH).returncode == 0
    fs = s3_store.filesystem()
    remote = {
        path.rsplit("/", 1)[1]: hashlib.sha256(fs.cat_file(path)).hexdigest()
        for path in fs.ls(url.removeprefix("s3://"))
    }
    assert remote == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local.iterdir()}
    checked = _shards_cli("verify", url)
    assert checked.returncode == 0 and checked.stdout.strip().endswith(")") and "; ok (" in checked.stdout
    again = _shards_cli("synth", "--out", url, "--stage", tmp_path / "stage", *SMALL_SYNTH)
    assert again.returncode == 2 and "already holds a shard set; pass --overwrite" in again.stderr
    # a damaged object in the store is found by verify, by name
    name = sorted(n for n in remote if n.startswith("train-"))[0]
    data = bytearray(fs.cat_file(f"vldist-tests/synth-small/{name}"))
    data[-2000] ^= 0xFF
    fs.pipe_file(f"vldist-tests/synth-small/{name}", bytes(data))
    damaged = _shards_cli("verify", url)
    assert damaged.returncode == 1 and f"problem: {name}: sha256 differs from manifest.json" in damaged.stdout


def test_a_set_being_written_is_refused_and_an_interrupted_upload_resumes(s3_store, planted_shards, tmp_path):
    from vldist.data.shardset import ShardSet
    from vldist.errors import ShardsNotFoundError
    from vldist.store.publish import INCOMPLETE, publish_set

    url, fs = "s3://vldist-tests/resumed", s3_store.filesystem()
    # an upload interrupted after two shards: the marker and those files are in the store, no manifest
    fs.pipe_file(f"vldist-tests/resumed/{INCOMPLETE}", b"")
    for path in sorted(planted_shards.glob("train-*.tar"))[:2]:
        fs.put_file(str(path), f"vldist-tests/resumed/{path.name}")
    with pytest.raises(ShardsNotFoundError, match="is being written, or its upload was interrupted"):
        ShardSet.open(url)
    files = [p for p in planted_shards.iterdir() if p.is_file()]
    assert publish_set(planted_shards, url) == len(files) - 2  # the two already there are not sent again
    assert ShardSet.open(url).manifest == ShardSet.open(planted_shards).manifest
    assert INCOMPLETE not in {p.rsplit("/", 1)[1] for p in fs.ls("vldist-tests/resumed", refresh=True)}


def test_a_conversion_writes_to_the_store_as_to_disk(s3_store, tmp_path):
    from dataset_fixtures import make_precomp

    from vldist.data.shardset import ShardSet

    make_precomp(tmp_path / "f30k_precomp", {"train": 30, "dev": 6, "test": 8})
    url, local = "s3://vldist-tests/converted", tmp_path / "local"
    for out in (url, local):
        done = _shards_cli(
            "convert",
            "precomp",
            "--src",
            tmp_path / "f30k_precomp",
            "--out",
            out,
            "--stage",
            tmp_path / "stage",
            "--shard-size",
            "10",
            "--workers",
            "1",
            "--quiet",
        )
        assert done.returncode == 0, done.stderr[-3000:]
    remote = ShardSet.open(url)
    assert remote.manifest == ShardSet.open(local).manifest and remote.num_samples("train") == 30
    assert _shards_cli("verify", url).returncode == 0


def test_each_shard_goes_up_when_finished_and_the_set_opens_only_when_whole(s3_store, tmp_path):
    import time

    from vldist.data.shardset import ShardSet
    from vldist.errors import ShardsNotFoundError
    from vldist.shards.format.writer import ShardSetWriter
    from vldist.store.publish import INCOMPLETE, upload_while_building

    url, fs, local = "s3://vldist-tests/streamed", s3_store.filesystem(), tmp_path / "building"
    listed = lambda: {p.rsplit("/", 1)[1] for p in fs.ls("vldist-tests/streamed", refresh=True)}  # noqa: E731
    with upload_while_building(local, url, every_s=0.1) as publisher:
        writer = ShardSetWriter(local, shard_size=2, source="test")
        for i in range(3):  # one whole shard (train-000000.tar) and one still open
            writer.write("train", {"__key__": f"train-{i:07d}", "json": {"captions": [f"caption {i}"]}})
        deadline = time.monotonic() + 30
        while "train-000000.tar" not in listed() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert listed() == {INCOMPLETE, "train-000000.tar"}  # the finished shard, not the open one, no manifest
        with pytest.raises(ShardsNotFoundError, match="is being written"):
            ShardSet.open(url)
        writer.close()
    assert publisher.finish(local) == 5  # two shards, their sample indexes and the manifest, each sent once
    shards = {"train-000000.tar", "train-000001.tar"}
    assert listed() == shards | {f"{name}.idx.json" for name in shards} | {"manifest.json"}
    assert ShardSet.open(url).num_samples("train") == 3


@pytest.fixture
def proxy(s3_store):
    """A fault-injecting proxy on 127.0.0.1 in front of the store (tests/fault_proxy.py)."""
    from fault_proxy import FaultProxy

    with FaultProxy(s3_store.endpoint) as proxy:
        yield proxy


def _key_and_regions(raw, rng):  # module level: workers over a store get it pickled
    import io

    import numpy as np

    return {"key": raw["__key__"], "regions": np.load(io.BytesIO(raw["regions.npy"]))}


def _keys(samples):
    return {"keys": [s["key"] for s in samples]}


def _keys_per_rank(urls, access, make_stream, workers=2):
    from vldist.data.pipeline import StreamSpec, make_loader

    keys = []
    for rank in range(2):
        spec = StreamSpec(
            urls=urls,
            keep=("json", "regions.npy"),
            sample_fn=_key_and_regions,
            collate_fn=_keys,
            batch_size=8,
            seed=3,
            rank=rank,
            world_size=2,
            access=access,
        )
        keys.append([k for batch in make_loader(make_stream(spec), workers) for k in batch["keys"]])
    return keys


@pytest.mark.parametrize("split", ["train", "test"])
def test_through_a_proxy_that_cuts_stalls_and_refuses_every_sample_arrives_as_from_disk(
    split, s3_set, planted_shards, proxy
):
    """The retry promise against the real store: each shard's first request answered 503 Slow Down,
    its first GET stalled past the client's read timeout, the next seven cut halfway (more than
    s3fs's own five tries: vldist's reader resumes); the samples of each rank, in order and counted
    per key, are those read from local disk."""
    from collections import Counter

    from vldist.data.pipeline import EvalStream, TrainStream
    from vldist.data.shardset import ShardSet
    from vldist.store.access import StoreAccess

    local = ShardSet.open(planted_shards).urls(split)
    access = StoreAccess(storage_options={"endpoint_url": proxy.url, "config_kwargs": {"read_timeout": 1}})
    remote = ShardSet.open(s3_set, access).urls(split)
    for url in local:
        name, size = url.rsplit("/", 1)[1], (planted_shards / url.rsplit("/", 1)[1]).stat().st_size
        proxy.faults.slow_down[name], proxy.faults.stall[name], proxy.faults.cut[name] = 1, [2.0], [size // 2] * 7
    make = (lambda spec: TrainStream(spec, 6, shuffle_buffer=40)) if split == "train" else EvalStream
    expected = _keys_per_rank(local, StoreAccess(), make)
    got = _keys_per_rank(remote, access, make)
    assert got == expected and [Counter(k) for k in got] == [Counter(k) for k in expected]
    if split == "test":  # an evaluation reads every sample of the split exactly once
        assert sorted(got[0] + got[1]) == sorted(set(got[0] + got[1]))
        assert len(got[0] + got[1]) == ShardSet.open(planted_shards).num_samples("test")
    reached = [name for name in proxy.faults.cut if proxy.faults.requests[name]]  # training draws shards at random
    assert len(reached) >= 2 and all(
        not proxy.faults.slow_down[n] and not proxy.faults.stall[n] and not proxy.faults.cut[n] for n in reached
    )  # each fault of each was met


def test_an_exact_epoch_reads_only_each_ranks_samples_by_ranged_reads_through_cuts_stalls_and_refusals(
    s3_set, planted_shards, proxy
):
    """Indexed exact epochs against the real store: each shard's first request answered 503, its
    first GET stalled past the read timeout, the next three cut a few hundred bytes in (ranged
    GETs are small); each rank's samples, in order, are those read from local disk, and the two
    ranks together ask the store for the set's bytes once."""
    from vldist.data.indexed_stream import IndexedSource, IndexedStream
    from vldist.data.sample_reader import read_stats
    from vldist.data.shardset import ShardSet
    from vldist.store.access import StoreAccess

    access = StoreAccess(storage_options={"endpoint_url": proxy.url, "config_kwargs": {"read_timeout": 1}})
    local_set, remote_set = ShardSet.open(planted_shards), ShardSet.open(s3_set, access)
    for url in local_set.urls("train"):
        name = url.rsplit("/", 1)[1]
        proxy.faults.slow_down[name], proxy.faults.stall[name], proxy.faults.cut[name] = 1, [2.0], [700] * 3

    def exact(shard_set):
        indexes = shard_set.sample_indexes("train")
        return lambda spec: IndexedStream(
            spec, [IndexedSource("train", spec.urls, indexes, spec.access)], shuffle_buffer=40, exact=True
        )

    expected = _keys_per_rank(local_set.urls("train"), StoreAccess(), exact(local_set), workers=0)
    read_stats.reset()
    got = _keys_per_rank(remote_set.urls("train"), access, exact(remote_set), workers=0)
    assert got == expected and sorted(got[0] + got[1]) == sorted(set(got[0] + got[1]))
    assert len(got[0] + got[1]) == 200
    total = sum((planted_shards / u.rsplit("/", 1)[1]).stat().st_size for u in local_set.urls("train"))
    assert read_stats.bytes < 1.01 * total  # both ranks together: the set once, not twice
    names = [url.rsplit("/", 1)[1] for url in local_set.urls("train")]
    assert all(proxy.faults.requests[n] > 5 and not proxy.faults.cut[n] and not proxy.faults.stall[n] for n in names)


def test_the_index_command_indexes_a_set_in_the_store(s3_store, planted_shards):
    """`vldist.shards index s3://...` on a set uploaded without indexes writes the indexes the
    writer wrote locally, and verify checks them there."""
    fs = s3_store.filesystem()
    fs.put(str(planted_shards), "vldist-tests/unindexed", recursive=True)
    for path in fs.glob("vldist-tests/unindexed/*.idx.json"):
        fs.rm_file(path)
    url = "s3://vldist-tests/unindexed"
    assert _shards_cli("index", url).returncode == 0
    for local in planted_shards.glob("*.idx.json"):
        assert fs.cat_file(f"vldist-tests/unindexed/{local.name}").decode() == local.read_text()
    assert _shards_cli("verify", url).returncode == 0
