"""The streaming pipeline over real tar shards: read-back, equal step counts, corrupt samples."""

import gc
import io
import json
import shutil
import tarfile
import time

import numpy as np
import pytest
from helpers import write_tar

from vldist.data.pipeline import EvalStream, StreamSpec, TrainStream, batches_per_rank, make_loader
from vldist.data.shardset import ShardSet
from vldist.errors import ShardsNotFoundError


def _sample(raw, rng):
    return {"key": raw["__key__"], "meta": json.loads(raw["json"]), "regions": np.load(io.BytesIO(raw["regions.npy"]))}


def _collate(samples):
    return {"keys": [s["key"] for s in samples], "samples": samples}


def _spec(urls, batch_size=16, rank=0, world=1, seed=0):
    return StreamSpec(
        urls=urls,
        keep=("json", "regions.npy"),
        sample_fn=_sample,
        collate_fn=_collate,
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world,
    )


def _read_tar_directly(path):
    members = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            members.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return members


def test_eval_stream_reads_back_every_sample_identically(planted_shards):
    shards = ShardSet.open(planted_shards)
    urls = shards.urls("train")
    truth = {}
    for u in urls:
        truth.update(_read_tar_directly(u))
    seen = {}
    for workers in (0, 2):
        seen = {}
        for batch in make_loader(EvalStream(_spec(urls)), workers):
            for s in batch["samples"]:
                assert s["key"] not in seen, "a sample was read twice"
                seen[s["key"]] = s
        assert set(seen) == set(truth)
    for key, s in seen.items():
        assert s["meta"] == json.loads(truth[key]["json"])
        assert np.array_equal(s["regions"], np.load(io.BytesIO(truth[key]["regions.npy"])))
    assert len(seen) == shards.num_samples("train") == 200


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_every_rank_yields_the_same_number_of_batches(planted_shards, workers):
    urls = ShardSet.open(planted_shards).urls("test")  # 60 samples in 2 shards: fewer shards than workers x ranks
    steps = batches_per_rank(samples_per_epoch=60, global_batch=16)
    counts = []
    for rank in range(2):
        stream = TrainStream(_spec(urls, batch_size=8, rank=rank, world=2), steps, shuffle_buffer=10)
        batches = list(make_loader(stream, workers))
        assert all(len(b["keys"]) == 8 for b in batches)
        counts.append(len(batches))
    assert counts == [steps, steps]


def _with_frozen_count(raw, rng):
    # gc.get_objects() lists the objects the collector still tracks, not the frozen ones
    return {"key": raw["__key__"], "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}


def test_loader_workers_freeze_what_they_inherit_and_the_trainer_does_not(planted_shards):
    """A worker's collections go through the objects it makes, not the ~200,000 it starts with (torch
    and what it inherits: the trainer's when forked, the preloads when from the fork server, which an
    earlier test's store may have chosen): those are frozen as it starts; the process that made the
    loader is left as it was."""
    urls = ShardSet.open(planted_shards).urls("train")
    spec = StreamSpec(urls=urls, keep=("json",), sample_fn=_with_frozen_count, collate_fn=_collate, batch_size=8)
    before = gc.get_freeze_count()
    samples = [s for b in make_loader(EvalStream(spec), 1) for s in b["samples"]]
    assert len(samples) == 200
    # torch alone makes over 100,000 objects; what the worker made since is a small part of them
    assert all(s["frozen"] > 100_000 and s["frozen"] > 5 * s["tracked"] for s in samples), samples[0]
    assert gc.get_freeze_count() == before
    in_process = [s for b in make_loader(EvalStream(spec), 0) for s in b["samples"]]
    assert all(s["frozen"] == before for s in in_process)


def test_the_shuffle_buffer_holds_raw_bytes_and_only_yielded_samples_are_decoded(planted_shards):
    """Decoding after the shuffle (as WebDataset's and open_clip's pipelines do): a rank that takes
    3 batches of 8 through a buffer of 100 decodes 24 samples, not the 100 the buffer filled with."""
    urls = ShardSet.open(planted_shards).urls("train")
    decoded = []

    def counting(raw, rng):
        decoded.append(raw["__key__"])
        return _sample(raw, rng)

    spec = StreamSpec(urls=urls, keep=("json", "regions.npy"), sample_fn=counting, collate_fn=_collate, batch_size=8)
    keys = [k for b in make_loader(TrainStream(spec, 3, shuffle_buffer=100), 0) for k in b["keys"]]
    assert len(keys) == 24 and decoded == keys


def test_training_order_is_seeded_by_rank_and_epoch(planted_shards):
    urls = ShardSet.open(planted_shards).urls("train")

    def keys(rank, epoch, seed=0):
        stream = TrainStream(_spec(urls, rank=rank, world=2, seed=seed), 4, shuffle_buffer=50)
        stream.epoch = epoch
        return [k for b in make_loader(stream, 0) for k in b["keys"]]

    assert keys(0, 0) == keys(0, 0)
    assert keys(0, 0) != keys(1, 0)
    assert keys(0, 0) != keys(0, 1)
    assert keys(0, 0) != keys(0, 0, seed=1)


def test_truncated_tar_and_corrupt_member_are_skipped_and_counted(planted_shards, tmp_path, caplog):
    urls = ShardSet.open(planted_shards).urls("test")
    good, damaged = urls
    # a corrupt .npy member inside an otherwise fine shard
    members = _read_tar_directly(damaged)
    bad_key = sorted(members)[3]
    corrupt = tmp_path / "test-000001.tar"
    write_tar(
        corrupt,
        {
            f"{key}.{ext}": b"not an npy file" if (key, ext) == (bad_key, "regions.npy") else data
            for key in sorted(members)
            for ext, data in sorted(members[key].items())
        },
    )
    # a tar cut off in the middle of a member
    truncated = tmp_path / "test-000000.tar"
    data = open(good, "rb").read()
    truncated.write_bytes(data[: len(data) // 2 + 100])

    keys, skipped = [], 0
    with caplog.at_level("WARNING", logger="vldist.data"):
        for batch in make_loader(EvalStream(_spec([str(truncated), str(corrupt)])), 0):
            keys += batch.get("keys", [])  # a last report of skips alone carries no samples
            skipped += batch["skipped"]
    assert bad_key not in keys
    assert len(keys) == len(set(keys))
    survivors = len(members) - 1
    assert sum(k in members for k in keys) == survivors  # every other sample of the corrupt shard survives
    good_count = len(_read_tar_directly(good))
    assert 0 < len(keys) - survivors < good_count  # part of the truncated shard was read before the cut
    assert skipped >= 2  # the corrupt member and the truncation
    assert "skipping corrupt sample" in caplog.text


def test_missing_shard_directory_says_how_to_build_it(tmp_path):
    with pytest.raises(ShardsNotFoundError) as err:
        ShardSet.open(tmp_path / "nowhere")
    assert "python -m vldist.shards synth --out" in str(err.value)
    assert "does not exist" in str(err.value)


def test_missing_split_and_missing_listed_shard(planted_shards, tmp_path):
    with pytest.raises(ShardsNotFoundError, match="no shards for split 'dev'"):
        ShardSet.open(planted_shards).urls("dev")
    copy = tmp_path / "copy"
    shutil.copytree(planted_shards, copy)
    (copy / "val-000000.tar").unlink()
    with pytest.raises(ShardsNotFoundError, match="missing"):
        ShardSet.open(copy).urls("val")


def test_shards_without_manifest_are_found_by_name(planted_shards, tmp_path):
    copy = tmp_path / "plain"
    shutil.copytree(planted_shards, copy)
    (copy / "manifest.json").unlink()
    assert [u.rsplit("/", 1)[1] for u in ShardSet.open(copy).urls("train")] == [f"train-00000{i}.tar" for i in range(4)]


def test_vocab_is_rebuilt_from_train_captions_when_absent(planted_shards, tmp_path):
    copy = tmp_path / "novocab"
    shutil.copytree(planted_shards, copy)
    (copy / "vocab.json").unlink()
    vocab = ShardSet.open(copy).vocab(tmp_path / "cache")
    assert (tmp_path / "cache" / "vocab.json").is_file()
    assert vocab.decode(vocab.encode("red circle")) == "red circle"


def test_a_minimum_count_turns_rare_train_words_into_unk(planted_shards, tmp_path):
    import collections
    import json
    import tarfile

    counts = collections.Counter()
    for shard in sorted(planted_shards.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    for caption in json.loads(tar.extractfile(member).read())["captions"]:
                        counts.update(caption.lower().replace(".", " ").split())
    min_count = sorted(set(counts.values()))[1]  # keeps some words, drops the rarest
    vocab = ShardSet.open(planted_shards).vocab(tmp_path / "cache", min_count=min_count)
    assert set(vocab.itos[4:]) == {w for w, n in counts.items() if n >= min_count}
    rare = next(w for w, n in counts.items() if n < min_count)
    assert vocab.encode(rare)[1] == vocab.unk_id
    assert (tmp_path / "cache" / f"vocab-min{min_count}.json").is_file()


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_epoch_sees_every_sample_once_across_two_ranks(planted_shards, workers):
    from vldist.data.pipeline import ExactEpochStream, exact_epoch_steps

    urls = ShardSet.open(planted_shards).urls("train")  # 200 samples in 4 shards
    steps = exact_epoch_steps(200, global_batch=32, world_size=2)
    assert steps == 7  # 6 full global batches + a last one of 8 rows, 4 per rank
    for epoch in (0, 1):
        per_rank = []
        for rank in range(2):
            stream = ExactEpochStream(_spec(urls, batch_size=16, rank=rank, world=2), samples=200, shuffle_buffer=40)
            stream.epoch = epoch
            batches = list(make_loader(stream, workers))
            assert len(batches) == steps
            assert [len(b["keys"]) for b in batches] == [16] * 6 + [4]
            per_rank.append([k for b in batches for k in b["keys"]])
        seen = per_rank[0] + per_rank[1]
        assert len(seen) == len(set(seen)) == 200  # none dropped, none twice
        assert not set(per_rank[0]) & set(per_rank[1])
    assert per_rank[0] != sorted(per_rank[0])  # shuffled


def test_exact_epoch_order_changes_with_the_epoch(planted_shards):
    from vldist.data.pipeline import ExactEpochStream

    urls = ShardSet.open(planted_shards).urls("train")

    def keys(epoch):
        stream = ExactEpochStream(_spec(urls, batch_size=16, rank=0, world=2), samples=200, shuffle_buffer=40)
        stream.epoch = epoch
        return [k for b in make_loader(stream, 0) for k in b["keys"]]

    assert keys(0) == keys(0) and keys(0) != keys(1)


def test_corrupt_image_is_skipped_and_counted(tmp_path):
    from PIL import Image

    from vldist.shards.format.writer import ShardSetWriter

    def jpeg(seed):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (seed * 40 % 255, 80, 160)).save(buf, format="JPEG")
        return buf.getvalue()

    with ShardSetWriter(tmp_path / "imgs", shard_size=10, source="test") as writer:
        for i in range(6):
            data = jpeg(i) if i != 2 else jpeg(i)[:40]  # image 2 is cut off mid-stream
            writer.write("train", {"__key__": f"img{i}", "jpg": data, "json": {"captions": ["x"]}})

    def decode_image(raw, rng):
        image = Image.open(io.BytesIO(raw["jpg"]))
        image.load()  # decoding happens here; a damaged JPEG raises
        return {"key": raw["__key__"], "size": image.size}

    spec = StreamSpec(
        urls=ShardSet.open(tmp_path / "imgs").urls("train"),
        keep=("jpg", "json"),
        sample_fn=decode_image,
        collate_fn=_collate,
        batch_size=10,
    )
    batches = list(make_loader(EvalStream(spec), 0))
    keys = [k for b in batches for k in b["keys"]]
    assert keys == ["img0", "img1", "img3", "img4", "img5"]
    assert sum(b["skipped"] for b in batches) == 1
    reasons = [r for b in batches for r in b["skip_reasons"]]
    assert len(reasons) == 1 and "img2" not in keys and reasons[0].startswith("OSError")


def test_workers_over_a_store_or_beside_fsspecs_io_thread_start_from_a_fork_server(planted_shards, monkeypatch):
    """fsspec's async stores are not fork-safe: where shards come from a URL, or this process runs
    fsspec's IO thread (a checkpoint store), workers start from a fork server, and read the same
    batches as forked ones; plain local shards in a process without that thread still fork."""
    import threading

    import fsspec.asyn

    from vldist.data.pipeline import _worker_start

    urls = ShardSet.open(planted_shards).urls("train")
    local = EvalStream(_spec(urls))
    forked = None
    if fsspec.asyn.iothread[0] is None:  # another test in this process may have started it
        assert _worker_start(local) is None
        forked = [k for b in make_loader(local, 2) for k in b["keys"]]
    remote = EvalStream(_spec(["file://" + u for u in urls]))
    assert _worker_start(remote).get_start_method() == "forkserver"
    monkeypatch.setattr(fsspec.asyn, "iothread", [threading.current_thread()])  # as after any s3fs request
    assert _worker_start(local).get_start_method() == "forkserver"
    served = [k for b in make_loader(remote, 2) for k in b["keys"]]
    assert sorted(served) == sorted(k for b in make_loader(local, 0) for k in b["keys"])
    assert forked is None or served == forked  # the workers' batches interleave alike


def _environment_sample(raw, rng):
    import os

    return {"key": raw["__key__"], "seen": os.environ.get("VLDIST_TEST_SEEN")}


def test_workers_from_the_fork_server_see_the_environment_of_their_loaders_start(planted_shards, monkeypatch):
    """The server's children would have the environment of the server's start: a store's
    credentials set later (a test's, a notebook's) must reach them too."""
    urls = ["file://" + u for u in ShardSet.open(planted_shards).urls("train")]
    spec = StreamSpec(urls=urls, keep=("json",), sample_fn=_environment_sample, collate_fn=_collate, batch_size=16)
    list(make_loader(EvalStream(spec), 1))  # the server runs from here on
    monkeypatch.setenv("VLDIST_TEST_SEEN", "after the server's start")
    assert {s["seen"] for b in make_loader(EvalStream(spec), 2) for s in b["samples"]} == {"after the server's start"}


def test_the_fork_server_and_its_workers_ignore_the_stop_signals_from_their_start(planted_shards):
    """torchrun and Slurm signal the whole process group: a stop must reach the trainer only (it
    checkpoints), not end the fork server or a worker that has not yet set its own handlers."""
    import os
    import signal
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # a server another test started, without the stop signals ignored
    urls = ["file://" + u for u in ShardSet.open(planted_shards).urls("train")]
    keys = [k for b in make_loader(EvalStream(_spec(urls)), 2, (signal.SIGUSR1,)) for k in b["keys"]]
    assert len(keys) == ShardSet.open(planted_shards).num_samples("train")
    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGUSR1)  # its default action ends a process
    time.sleep(0.5)
    assert os.waitpid(server, os.WNOHANG) == (0, 0)  # still running
    assert [k for b in make_loader(EvalStream(_spec(urls)), 2, (signal.SIGUSR1,)) for k in b["keys"]] == keys
