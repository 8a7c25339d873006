"""Training streams over indexed shards (data/indexed_stream.py): an exact epoch sees every sample
once across any number of ranks and reads on each rank only that rank's samples; a pass begun at
batch k yields what an uninterrupted pass yields from k, on the same or another number of ranks;
the batches do not depend on the number of loader workers; the windowed order keeps each batch's
reads within a few shards."""

import itertools
from collections import Counter

import pytest

from vldist.data.epoch_order import ExactOrder, ResampledOrder
from vldist.data.indexed_stream import IndexedSource, IndexedStream
from vldist.data.pipeline import StreamSpec, exact_epoch_steps, make_loader
from vldist.data.sample_reader import read_stats
from vldist.data.shardset import ShardSet

SAMPLES = 200  # planted_shards' train split: 4 shards of 50


def _sample(raw, rng):
    return {"key": raw["__key__"], "draw": rng.random()}


def _collate(samples):
    return {"keys": [s["key"] for s in samples], "draws": [s["draw"] for s in samples]}


def _stream(shards, world=1, rank=0, global_batch=24, exact=True, buffer=20, batches=None) -> IndexedStream:
    shard_set = ShardSet.open(shards)
    spec = StreamSpec(
        urls=shard_set.urls("train"),
        keep=("json",),
        sample_fn=_sample,
        collate_fn=_collate,
        batch_size=global_batch // world,
        rank=rank,
        world_size=world,
    )
    source = IndexedSource("train", spec.urls, shard_set.sample_indexes("train"))
    return IndexedStream(spec, [source], buffer, exact, batches=batches)


def _read(stream: IndexedStream, epoch=0, first=0, workers=0) -> list[list[str]]:
    stream.epoch, stream.first_batch = epoch, first
    return [b["keys"] for b in make_loader(stream, workers)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_exact_epoch_deals_every_sample_once_in_equal_steps_and_each_rank_reads_only_its_own(planted_shards, world):
    index_bytes = {
        key: size
        for index in ShardSet.open(planted_shards).sample_indexes("train")
        for key, size in zip(index.keys, index.sizes, strict=True)
    }
    ranks = []
    for rank in range(world):
        read_stats.reset()
        ranks.append(_read(_stream(planted_shards, world, rank)))
        mine = [k for batch in ranks[-1] for k in batch]
        # only its own samples' bytes, each once (adjacent ones in one read)
        assert read_stats.bytes == sum(index_bytes[k] for k in mine)
    steps = exact_epoch_steps(SAMPLES, 24, world)
    assert all(len(batches) == steps for batches in ranks)
    for step in range(steps - 1):
        assert {len(batches[step]) for batches in ranks} == {24 // world}
    seen = Counter(k for batches in ranks for batch in batches for k in batch)
    assert len(seen) == SAMPLES and set(seen.values()) == {1}


def test_the_global_order_is_the_same_for_any_number_of_ranks_and_workers(planted_shards):
    one = _read(_stream(planted_shards))
    for world, workers in ((1, 2), (2, 0), (3, 2)):
        ranks = [_read(_stream(planted_shards, world, r), workers=workers) for r in range(world)]
        assert [list(itertools.chain(*rows)) for rows in zip(*ranks, strict=True)] == one
    assert _read(_stream(planted_shards), epoch=1) != one  # each epoch its own order


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_begun_at_batch_k_yields_the_rest_of_the_uninterrupted_pass(planted_shards, exact, workers):
    def stream():
        return _stream(planted_shards, world=2, rank=1, exact=exact, batches=None if exact else 9)

    whole = stream()
    whole.epoch, whole.first_batch = 1, 0
    reference = list(make_loader(whole, 0))
    for k in (1, 4, len(reference) - 1):
        resumed = stream()
        resumed.epoch, resumed.first_batch = 1, k
        got = list(make_loader(resumed, workers))
        assert [(b["keys"], b["draws"]) for b in got] == [(b["keys"], b["draws"]) for b in reference[k:]]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_an_epoch_resumed_on_another_number_of_ranks_trains_on_every_sample_once(planted_shards, before, after):
    k = 4  # global batches taken on `before` ranks, then the rest on `after` ranks
    first = [_read(_stream(planted_shards, before, r))[:k] for r in range(before)]
    rest = [_read(_stream(planted_shards, after, r), first=k) for r in range(after)]
    seen = Counter(key for rank in (*first, *rest) for batch in rank for key in batch)
    assert len(seen) == SAMPLES and set(seen.values()) == {1}
    assert {len(rank) for rank in rest} == {exact_epoch_steps(SAMPLES, 24, after) - k}


def test_resampled_batches_differ_between_ranks_and_epochs_and_not_with_workers(planted_shards):
    def keys(rank=0, epoch=0, workers=0):
        return _read(_stream(planted_shards, 2, rank, exact=False, batches=6), epoch, workers=workers)

    base = keys()
    assert len(base) == 6 and all(len(b) == 12 for b in base)
    assert keys(rank=1) != base and keys(epoch=1) != base and keys(workers=2) == base


def test_the_windowed_order_keeps_each_batch_within_a_few_shards():
    counts = [50] * 40
    windowed = ExactOrder(counts, seed=0, epoch=0, window=20)
    shards_per_batch = [len({s for s, _ in windowed.samples(p, p + 24)}) for p in range(0, 2000 - 24, 24)]
    assert max(shards_per_batch) <= 2  # 24 consecutive positions of windows of 20 lie in 2 shards at most
    everything = sorted(windowed.samples(0, 2000))
    assert everything == [(s, r) for s in range(40) for r in range(50)]
    draws = ResampledOrder(counts, seed=0, epoch=0, rank=0, window=100)
    assert all(len({s for s, _ in draws.samples(p, p + 24)}) <= 4 for p in range(0, 1000, 24))


def test_a_corrupt_sample_or_a_stale_index_entry_is_skipped_and_counted(planted_shards, tmp_path):
    import json
    import shutil

    stale = tmp_path / "stale"
    shutil.copytree(planted_shards, stale)
    path = stale / "train-000000.tar.idx.json"
    index = json.loads(path.read_text())
    for field in ("offsets", "sizes"):  # rows 0 and 1 point at each other's bytes
        index[field][0], index[field][1] = index[field][1], index[field][0]
    path.write_text(json.dumps(index))
    stream = _stream(stale)
    batches = list(make_loader(stream, 0))
    got = [k for batch in batches for k in batch["keys"]]
    reasons = [r for batch in batches for r in batch["skip_reasons"]]
    assert sum(batch["skipped"] for batch in batches) == 2
    assert "IndexMismatch" in reasons[0] and "python -m vldist.shards index" in reasons[0]
    assert len(got) == SAMPLES - 2 and not {"train-0000000", "train-0000001"} & set(got)


def test_a_batch_of_which_nothing_can_be_read_ends_the_run_by_name_instead_of_leaving_the_ranks_out_of_step(
    planted_shards,
):
    from vldist.errors import UnreadableBatch

    def unreadable(raw, rng):
        raise ValueError("damaged")

    stream = _stream(planted_shards, world=2, rank=1)
    stream.spec.sample_fn = unreadable
    with pytest.raises(UnreadableBatch, match=r"none of rank 1's 12 samples of batch 1 of epoch 1 could be read"):
        _read(stream)


def test_a_resampled_row_that_cannot_be_read_is_drawn_again_alike_on_every_pass(planted_shards):
    def some_unreadable(raw, rng):
        if raw["__key__"].endswith(("3", "7")):  # a fifth of the samples
            raise ValueError("damaged")
        return _sample(raw, rng)

    def keys(first=0):
        stream = _stream(planted_shards, world=2, rank=0, exact=False, batches=8)
        stream.spec.sample_fn = some_unreadable
        stream.epoch, stream.first_batch = 0, first
        return [b["keys"] for b in make_loader(stream, 0)]

    batches = keys()
    assert [len(b) for b in batches] == [12] * 8  # every row drawn again until readable
    assert not any(k.endswith(("3", "7")) for b in batches for k in b)
    assert keys(first=5) == batches[5:]  # the redraws are the same on a resumed pass
