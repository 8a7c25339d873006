"""Loaders that keep their workers from epoch to epoch yield the stream of loaders started afresh
each epoch (as before), to the sample, in exact and resampled epochs, and a run stopped mid-epoch
and resumed reads what an uninterrupted one does; the workers end when an epoch is left unfinished
and after the run's last epoch."""

import os
import random
from itertools import islice

import pytest
from helpers import OneStreamRecipe

from vldist.data.job_shards import JobShards
from vldist.data.pipeline import EvalStream, StreamSpec, make_loader
from vldist.data.shardset import ShardSet
from vldist.data.streams import TrainingStreams
from vldist.recipes.jobs import load_config

EPOCHS = 3


def _sample(raw, rng):
    # random.random(): the worker's global generator, which a recipe may draw from as well
    return {"key": raw["__key__"], "draw": (rng.random(), random.random()), "pid": os.getpid()}


def _collate(samples):
    return {key: [s[key] for s in samples] for key in ("key", "draw", "pid")}


def _streams(planted_shards, resampled: bool, workers: int) -> TrainingStreams:
    config = load_config(
        "vsrn",
        [
            f"data.shards={planted_shards}",
            "data.batch_size=32",
            "data.shuffle_buffer=20",
            f"data.workers={workers}",
            f"data.resampled={str(resampled).lower()}",
            f"train.epochs={EPOCHS}",
        ],
    )
    return TrainingStreams(
        config, OneStreamRecipe(_sample, _collate), JobShards(ShardSet.open(planted_shards)), rank=1, world_size=2
    )


def _fresh_each_epoch(streams: TrainingStreams, epoch: int) -> list:
    """The epoch as read before loaders persisted: a loader with new workers, epoch set first."""
    (stream,) = streams.streams.values()
    stream.epoch = epoch
    return [p for b in make_loader(stream, streams.config.data.workers) for p in _pairs(b)]


def _pairs(batch: dict) -> list:
    return [(key, tuple(draw)) for key, draw in zip(batch["key"], batch["draw"], strict=True)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("resampled", [True, False])
def test_persistent_workers_read_every_epoch_as_fresh_ones_and_a_resume_reads_on_alike(
    planted_shards, unindexed_shards, resampled, indexed
):
    """Indexed sets begin a resumed pass at its step; sets without an index read up to it."""
    if not indexed:
        planted_shards = unindexed_shards
    streams = _streams(planted_shards, resampled, workers=2)
    reference = _streams(planted_shards, resampled, workers=2)
    read, pids = [], set()
    for epoch in range(EPOCHS):
        batches = list(streams.batches(epoch))
        assert len(batches) == streams.micro_per_epoch
        read.append([p for b in batches for p in _pairs(b)])
        pids |= {p for b in batches for p in b["pid"]}
        assert streams.begun == ((epoch + 1, 0) if epoch + 1 < EPOCHS else None)  # the next epoch begun at once
    assert read == [_fresh_each_epoch(reference, epoch) for epoch in range(EPOCHS)]
    assert read[0] != read[1] and (resampled or len({k for k, _ in read[0]}) == len(read[0]))
    assert len(pids) == 2  # the same two workers all along
    assert not streams.loaders and not any(_alive(p) for p in pids)  # ended after the last epoch

    # a run stopped at step 3 of epoch 1, then resumed: in the same process, and in a new one
    stop = 3
    with_stop = _streams(planted_shards, resampled, workers=2)
    list(with_stop.batches(0))
    first = with_stop.batches(1)
    taken = [p for b in islice(first, stop) for p in _pairs(b)]
    first.close()
    assert not with_stop.loaders  # left unfinished: its workers ended at once
    for resumed in (with_stop, _streams(planted_shards, resampled, workers=2)):
        rest = [p for b in resumed.batches(1, stop) for p in _pairs(b)]
        assert taken + rest == read[1]
        assert [p for b in resumed.batches(2) for p in _pairs(b)] == read[2]


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_persistent_loader_keeps_its_workers_for_whole_passes_and_ends_them_after_a_partial_one(
    planted_shards, scheme
):
    """The validation split's loader (evaluations.py): every pass reads the split alike, with the
    same workers; a pass left unfinished (a failed evaluation) ends them, and the next starts anew.
    Forked workers, and (file://, as from a store) workers from the fork server."""
    urls = [scheme + u for u in ShardSet.open(planted_shards).urls("test")]  # 2 shards: one a worker
    spec = StreamSpec(urls=urls, keep=("json",), sample_fn=_sample, collate_fn=_collate, batch_size=8)
    loader = make_loader(EvalStream(spec), 2, persistent=True)
    passes = [list(loader) for _ in range(2)]
    assert [b["key"] for b in passes[0]] == [b["key"] for b in passes[1]]
    assert [b["draw"] for b in passes[0]] == [b["draw"] for b in passes[1]]
    workers = {p for b in passes[0] + passes[1] for p in b["pid"]}
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    partial = iter(loader)
    next(partial)
    partial.close()
    assert not any(_alive(p) for p in workers)
    again = list(loader)
    assert [b["key"] for b in again] == [b["key"] for b in passes[0]]
    assert not {p for b in again for p in b["pid"]} & workers
    loader.close()


def test_workers_from_the_fork_server_take_each_epoch_from_the_shared_value(planted_shards):
    """Shards from a store (file:// here) start workers from the fork server, which get the
    stream, its SharedEpoch with it, pickled: they read each epoch as forked fresh ones do."""
    from vldist.data.pipeline import TrainStream

    urls = ShardSet.open(planted_shards).urls("train")

    def stream(scheme: str) -> TrainStream:
        spec = StreamSpec(
            urls=[scheme + u for u in urls], keep=("json",), sample_fn=_sample, collate_fn=_collate, batch_size=8
        )
        return TrainStream(spec, 6, shuffle_buffer=20)

    served, fresh = stream("file://"), stream("")
    loader = make_loader(served, 2, persistent=True)
    try:
        for epoch in range(EPOCHS):
            served.epoch = fresh.epoch = epoch
            assert [p for b in loader for p in _pairs(b)] == [p for b in make_loader(fresh, 2) for p in _pairs(b)]
    finally:
        loader.close()


def test_a_set_without_an_index_trains_and_says_once_how_to_index_it(planted_shards, unindexed_shards, caplog):
    with caplog.at_level("WARNING", logger="vldist.data"):
        streams = _streams(unindexed_shards, resampled=False, workers=0)
        list(streams.batches(0))
    said = [r.getMessage() for r in caplog.records if "no sample index" in r.getMessage()]
    assert len(said) == 1 and f"python -m vldist.shards index {unindexed_shards}" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="vldist.data"):
        _streams(planted_shards, resampled=False, workers=0)
    assert not [r for r in caplog.records if "no sample index" in r.getMessage()]
