"""Weighted sources (data.sources): the mix of every run of positions is within one sample of the
weights, exactly so over whole periods; an exact epoch over two sources on 1 and 2 ranks takes
each source's share exactly (a source drawn more often than it has samples read again, each
sample as often as any other), every global batch within a row of the proportions; resampled
batches keep the mix per rank; bad configurations are refused by name."""

from collections import Counter

import numpy as np
import pytest
from helpers import OneStreamRecipe

from vldist.data.indexed_stream import IndexedSource, IndexedStream
from vldist.data.job_shards import JobShards
from vldist.data.mixture import PERIOD, Mixture
from vldist.data.pipeline import StreamSpec, make_loader
from vldist.data.shardset import ShardSet
from vldist.data.streams import TrainingStreams
from vldist.recipes.jobs import load_config


def test_every_run_of_positions_holds_each_source_within_one_sample_of_its_weight():
    weights = [2.0, 1.0, 0.5]
    mixture = Mixture(weights)
    share = np.asarray(weights) / sum(weights)
    sources = np.asarray([s for s, _ in mixture.draws(0, 3 * PERIOD)])
    for start, length in ((0, 32), (77, 100), (9_990, 64), (12_345, 1_000)):
        counts = np.bincount(sources[start : start + length], minlength=3)
        assert (np.abs(counts - length * share) < 1 + 1e-9).all(), (start, length, counts)
    assert list(np.bincount(sources[:PERIOD])) == list(mixture.shares)  # a whole period: the rounded shares
    assert list(mixture.shares) == [round(PERIOD * w) for w in share]
    for position in (0, 5, 4_321, 2 * PERIOD + 17):  # taken() agrees with counting the draws
        assert list(mixture.taken(position)) == list(np.bincount(sources[:position], minlength=3))
    assert mixture.draws(4_000, 4_010) == mixture.draws(0, 4_010)[4_000:]  # found without the draws before
    with pytest.raises(ValueError, match="must be positive"):
        Mixture([1.0, 0.0])


def _key(raw, rng):  # module level: loader workers from a fork server get them pickled
    return {"key": raw["__key__"]}


def _keys(samples):
    return {"keys": [s["key"] for s in samples]}


def _two_sources(planted, other, weights=(2.0, 1.0), world=1, rank=0, exact=True, samples=None, batches=None):
    sources = []
    for name, directory, weight in (("main", planted, weights[0]), ("other", other, weights[1])):
        shard_set = ShardSet.open(directory)
        sources.append(IndexedSource(name, shard_set.urls("train"), shard_set.sample_indexes("train"), weight=weight))
    spec = StreamSpec(
        urls=[u for s in sources for u in s.urls],
        keep=("json",),
        sample_fn=_key,
        collate_fn=_keys,
        batch_size=24 // world,
        rank=rank,
        world_size=world,
    )
    return IndexedStream(spec, sources, 20, exact, samples=samples, batches=batches)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("epoch_samples", [300, 600])
def test_an_exact_epoch_takes_each_sources_share_exactly(planted_shards, other_planted_shards, world, epoch_samples):
    # main: 200 samples at weight 2, other: 120 at weight 1
    ranks = []
    for rank in range(world):
        stream = _two_sources(planted_shards, other_planted_shards, world=world, rank=rank, samples=epoch_samples)
        ranks.append(list(make_loader(stream, 2 if rank else 0)))
    keys = Counter(k for batches in ranks for b in batches for k in b["keys"])
    main = {k: n for k, n in keys.items() if not k.startswith("other-")}
    other = {k: n for k, n in keys.items() if k.startswith("other-")}
    expected = Mixture([2.0, 1.0]).taken(epoch_samples)
    assert (sum(main.values()), sum(other.values())) == tuple(expected)
    # main's share is 200 (300 samples) or 400 (600): every sample once or twice, none more than another
    assert len(main) == min(200, expected[0]) and set(main.values()) == {expected[0] // 200 or 1}
    # other's 100 of 120 in the first epoch's order, or all 120 once and 80 of them again
    assert len(other) == min(120, expected[1]) and max(other.values()) - min(other.values()) <= 1
    for step in zip(*ranks, strict=True):  # each global batch: the rows' counts match the batch's own counts
        rows = [k for b in step for k in b["keys"]]
        counted = sum(b["source_counts"]["other"] for b in step)
        assert counted == sum(k.startswith("other-") for k in rows)
        if len(rows) == 24:
            assert abs(counted - 8) <= 1


def test_resampled_batches_keep_the_mix_on_every_rank(planted_shards, other_planted_shards):
    for rank in (0, 1):
        stream = _two_sources(planted_shards, other_planted_shards, (1.0, 3.0), 2, rank, exact=False, batches=20)
        batches = list(make_loader(stream, 0))
        assert len(batches) == 20
        for b in batches:
            others = sum(k.startswith("other-") for k in b["keys"])
            assert abs(others - 9) <= 1 and b["source_counts"] == {"main": 12 - others, "other": others}


def _training(planted, sources: str, resampled=False):
    config = load_config(
        "vsrn", [f"data.shards={planted}", f"data.sources={sources}", f"data.resampled={str(resampled).lower()}"]
    )
    recipe = OneStreamRecipe(_key, _keys)
    opened = {s.shards: ShardSet.open(s.shards) for s in config.data.sources}
    return TrainingStreams(config, recipe, JobShards(ShardSet.open(planted), opened), rank=0, world_size=1)


def test_a_job_reads_its_sources_and_refuses_one_without_an_index(
    planted_shards, other_planted_shards, unindexed_shards
):
    streams = _training(
        planted_shards,
        f"[{{shards: {planted_shards}, weight: 3, name: main}}, {{shards: {other_planted_shards}, name: other}}]",
    )
    assert streams.source_names() == ["main", "other"]
    (stream,) = streams.streams.values()
    assert [s.weight for s in stream.sources] == [3.0, 1.0] and stream.samples == 320
    with pytest.raises(ValueError, match=r"has no sample index: index it with `python -m vldist.shards index"):
        _training(planted_shards, f"[{{shards: {unindexed_shards}, name: a}}, {{shards: {other_planted_shards}}}]")
    from vldist.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.sources names \['shards'\] more than once"):
        _training(planted_shards, f"[{{shards: {planted_shards}}}, {{shards: {other_planted_shards}}}]")
