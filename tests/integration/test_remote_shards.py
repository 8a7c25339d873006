"""Training and evaluation read a shard set from a URL exactly as from disk, through the faults of
a network: the planted set served by a real HTTP server on 127.0.0.1 (tests/fault_http.py) that
cuts connections mid-shard and answers 5xx on request. A cut read resumes at the byte it reached,
so the job's samples, losses and metrics equal a run from local disk; a shard that keeps failing
is skipped and counted, and the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fault_http import FaultyServer
from helpers import SMALL_VSRN

pytest.importorskip("aiohttp", reason='fsspec\'s HTTP filesystem needs aiohttp (pip install "vldist[http]")')


@pytest.fixture
def server(planted_shards):
    with FaultyServer(planted_shards.parent) as running:
        running.set_url = f"{running.url}/{planted_shards.name}"
        yield running


def _read(url, access=None):
    from vldist.store.reader import ResumableReader

    reader = ResumableReader(url, access, sleep=lambda seconds: None)
    chunks = []
    while chunk := reader.read(4096):
        chunks.append(chunk)
    return b"".join(chunks), reader


def test_a_cut_or_refused_read_resumes_at_the_byte_it_reached(planted_shards, server):
    shard = sorted(planted_shards.glob("train-*.tar"))[0]
    size = shard.stat().st_size
    server.faults.cut[shard.name] = [1, size // 3, size - 1]
    server.faults.status[shard.name] = [503, 502]
    data, reader = _read(f"{server.set_url}/{shard.name}")
    assert data == shard.read_bytes()
    assert reader.reopened == 5 and server.faults.gets[shard.name] == 6 and server.faults.cuts[shard.name] == 3


def test_a_shard_that_keeps_failing_gives_up_after_the_retries_and_a_missing_one_at_once(planted_shards, server):
    from vldist.store.access import StoreAccess
    from vldist.store.reader import ShardUnavailable
    from vldist.store.retry import RetryPolicy

    name = sorted(planted_shards.glob("train-*.tar"))[0].name
    server.faults.always[name] = 503
    with pytest.raises(ShardUnavailable, match=rf"{server.set_url}/{name}: 3 tries failed at byte 0"):
        _read(f"{server.set_url}/{name}", StoreAccess(retry=RetryPolicy(retries=2)))
    assert server.faults.gets[name] == 3
    with pytest.raises(FileNotFoundError):
        _read(f"{server.set_url}/train-999999.tar")
    assert server.faults.gets["train-999999.tar"] <= 1  # not tried again
    server.faults.always["test-000000.tar"] = 403
    with pytest.raises(Exception) as refused:
        _read(f"{server.set_url}/test-000000.tar")
    assert "403" in str(refused.value) and server.faults.gets["test-000000.tar"] == 1


def test_a_job_trains_from_a_url_cut_mid_shard_as_from_disk(planted_shards, server, tmp_path):
    from vldist.train import main as train_main

    for shard in planted_shards.glob("*.tar"):  # every shard's first GET is cut halfway
        server.faults.cut[shard.name] = [shard.stat().st_size // 2]
    runs = {}
    for name, shards in (("local", planted_shards), ("http", server.set_url)):
        out = tmp_path / name
        # two loader workers: each opens its own HTTP filesystem after the fork
        assert (
            train_main(
                ["vsrn", f"data.shards={shards}", f"output.dir={out}", "train.epochs=1", "data.workers=2", *SMALL_VSRN]
            )
            == 0
        )
        runs[name] = json.loads((out / "metrics.json").read_text())
    assert sum(server.faults.cuts.values()) >= 3  # train, val and test shards were cut and resumed
    assert runs["http"]["test"] == runs["local"]["test"]
    assert runs["http"]["config"]["data"]["shards"] == server.set_url
    assert runs["http"].get("skipped_samples", 0) == runs["local"].get("skipped_samples", 0) == 0
    losses = {
        name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open() if '"loss"' in line]
        for name in runs
    }
    assert losses["local"] and losses["http"] == losses["local"]


def test_a_shard_that_keeps_failing_is_skipped_and_the_run_goes_on(planted_shards, server, tmp_path):
    lost = sorted(planted_shards.glob("train-*.tar"))[0].name
    server.faults.always[lost] = 503
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={server.set_url}",
            f"output.dir={out}",
            "train.epochs=1",
            "data.retries=1",
            *SMALL_VSRN,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_samples"] > 0 and server.faults.gets[lost] >= 2
    # warned by the loader workers at the bounded rate of corrupt samples (data/skips.py)
    assert f"skipping an unreadable shard #1: ShardUnavailable: {server.set_url}/{lost}: 2 tries failed" in done.stderr


def test_a_store_that_does_not_answer_at_the_start_is_refused_in_one_line(tmp_path):
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards=http://127.0.0.1:{port}/shards",
            f"output.dir={tmp_path / 'run'}",
            *SMALL_VSRN,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"error: cannot read http://127.0.0.1:{port}/shards: " in done.stderr
    assert "Check the address and that the store is up" in done.stderr and "Traceback" not in done.stderr


def test_ranks_and_workers_of_a_node_download_each_shard_once_through_the_cache(
    two_rank_reference, server, planted_shards, tmp_path
):
    from helpers import PREEMPT_JOB, TORCHRUN

    out = tmp_path / "run"
    done = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={server.set_url}",
            f"output.dir={out}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.workers=2",
            *PREEMPT_JOB,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tars = {name: n for name, n in server.faults.gets.items() if name.endswith(".tar")}
    # 2 ranks x 2 workers x 2 epochs read the shards, each fetched from the server once (the
    # resampled draws need not reach every train shard; evaluation reads every other one)
    evaluated = {p.name for p in planted_shards.glob("*.tar") if not p.name.startswith("train-")}
    assert evaluated < set(tars) <= {p.name for p in planted_shards.glob("*.tar")} and set(tars.values()) == {1}
    reference = json.loads((two_rank_reference / "metrics.json").read_text())
    assert json.loads((out / "metrics.json").read_text())["test"] == reference["test"]


def _cache(tmp_path, max_bytes=1 << 30):
    from vldist.store.cache import CacheConfig, ShardCache
    from vldist.store.reader import ResumableReader

    return ShardCache(CacheConfig(str(tmp_path / "cache"), max_bytes)), lambda url: ResumableReader(url)


def test_a_changed_cached_copy_is_fetched_again_and_a_bad_download_is_not_kept(server, planted_shards, tmp_path):
    import hashlib

    from vldist.store.cache import ShardCorrupt

    cache, download = _cache(tmp_path)
    shard = sorted(planted_shards.glob("val-*.tar"))[0]
    url, sha = f"{server.set_url}/{shard.name}", hashlib.sha256(shard.read_bytes()).hexdigest()
    local = cache.fetch(url, download, sha)
    assert local.read_bytes() == shard.read_bytes() and cache.fetch(url, download, sha) == local
    assert server.faults.gets[shard.name] == 1
    with open(local, "r+b") as damaged:  # a partial or damaged copy: another size, another mtime
        damaged.truncate(100)
    assert cache.fetch(url, download, sha).read_bytes() == shard.read_bytes()
    assert server.faults.gets[shard.name] == 2
    other = sorted(planted_shards.glob("test-*.tar"))[0]
    with pytest.raises(ShardCorrupt, match=rf"{server.set_url}/{other.name}: the download does not check out"):
        cache.fetch(f"{server.set_url}/{other.name}", download, sha)  # another shard's checksum
    assert not cache.entry(f"{server.set_url}/{other.name}").exists()
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_the_cache_evicts_the_least_recently_used_shard_beyond_its_bound(server, planted_shards, tmp_path):
    import os

    shards = sorted(planted_shards.glob("train-*.tar"))[:3]
    bound = shards[0].stat().st_size + shards[1].stat().st_size + shards[2].stat().st_size - 1
    cache, download = _cache(tmp_path, bound)
    urls = [f"{server.set_url}/{s.name}" for s in shards]
    first = cache.fetch(urls[0], download)
    cache.fetch(urls[1], download)
    os.utime(first, ns=(1, first.stat().st_mtime_ns))  # used longest ago
    cache.fetch(urls[2], download)
    assert not first.exists() and all(cache.entry(u).exists() for u in urls[1:])
    cache.fetch(urls[0], download)
    assert server.faults.gets[shards[0].name] == 2 and server.faults.gets[shards[1].name] == 1


def test_a_store_that_goes_down_mid_run_ends_it_in_one_line_and_the_run_resumes_once_it_is_back(server, tmp_path):
    from helpers import wait_for_step

    out = tmp_path / "run"
    job = [
        sys.executable,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={server.set_url}",
        f"output.dir={out}",
        "train.epochs=20",
        "train.log_every=1",
        "train.save_every_steps=2",
        "data.retries=1",
        *SMALL_VSRN,
    ]
    proc = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, 3, proc)
        server.faults.down = True
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, stderr[-3000:]
    assert f"error: the store of {server.set_url}/" in stderr and "stopped answering" in stderr
    assert "train.resume=latest carries on" in stderr and "Traceback" not in stderr
    server.faults.down = False  # back: the run carries on from its last checkpoint
    done = subprocess.run([*job, "train.resume=latest", "train.epochs=2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resum" in done.stderr.lower()


def test_a_shard_lost_in_an_exact_epoch_ends_the_run_in_one_line_rather_than_skewing_the_ranks(
    planted_shards, server, tmp_path, capsys
):
    """Exact epochs (data.resampled=false) read every shard on every rank in one order: a shard
    skipped on one rank would shift that rank's rows against the others', so a lost shard ends the
    run, exit 1, saying what to do, where a resampled run skips it (the test above)."""
    from vldist.train import main as train_main

    lost = sorted(planted_shards.glob("train-*.tar"))[1].name
    server.faults.always[lost] = 503
    code = train_main(
        [
            "vsrn",
            f"data.shards={server.set_url}",
            f"output.dir={tmp_path / 'run'}",
            "train.epochs=1",
            "data.resampled=false",
            "data.retries=1",
            *SMALL_VSRN,
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and server.faults.gets[lost] >= 2
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert f"{server.set_url}/{lost}: 2 tries failed" in line and "An exact epoch (data.resampled=false)" in line
    assert "train.resume=latest" in line and "Traceback" not in err
