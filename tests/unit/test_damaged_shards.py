"""Shards cut short: the samples they lack are counted once, by shard, and an exact epoch over them
ends early at the same batch on every rank (docs/bad-input.md, "The data")."""

import pytest
from helpers import CUT_SHARD, cut_shard_copy

from vldist.data.pipeline import ExactEpochStream, StreamSpec, exact_epoch_steps, make_loader
from vldist.data.shard_stream import listed_counts, shard_samples
from vldist.data.shardset import ShardSet
from vldist.data.skips import MissingSamples, SkipCounter
from vldist.data.streams import SkipReport, _SkipsFolded


def _at_a_boundary(shard, ends):  # after the 20th sample's padding: tarfile takes it for the archive's end
    return ends[19]


def _mid_member(shard, ends):  # inside the 31st sample's data
    return ends[29] + 700


@pytest.mark.parametrize("at", [_at_a_boundary, _mid_member], ids=["at_a_member_boundary", "mid_member"])
def test_a_shard_cut_short_reports_the_samples_it_lacks_once_by_name(planted_shards, tmp_path, at):
    shards, whole = cut_shard_copy(planted_shards, tmp_path / "set", at)
    opened = ShardSet.open(shards)
    urls = opened.urls("train")
    listed = listed_counts(opened.manifest, "train", urls)
    assert listed == dict.fromkeys(urls, 50)
    reports = []
    samples = list(shard_samples(urls, lambda exn: reports.append(exn) or True, listed=listed))
    complete = [s for s in samples if "regions.npy" in s and "json" in s]
    # a sample whose member was cut is handed on incomplete (the decoder counts it), none after it
    partial = len(samples) - len(complete)
    assert len(complete) == 150 + whole and partial in (0, 1)
    assert len(reports) == 1 and isinstance(reports[0], MissingSamples)
    assert reports[0].samples == 50 - whole - partial  # each lost sample counted once, by one report
    assert reports[0].shard.endswith(CUT_SHARD) and f"{CUT_SHARD} holds {whole + partial} of the 50" in str(reports[0])
    # without the manifest's counts a cut at a boundary goes unseen (what the counts are for), and a
    # cut mid-member is counted by its tar errors, not by the samples it cost
    unseen = []
    assert len(list(shard_samples(urls, lambda exn: unseen.append(exn) or True))) == len(samples)
    assert not unseen if at is _at_a_boundary else 1 <= len(unseen) < 50 - whole


def test_the_skip_counter_counts_missing_samples_by_shard_and_warns_at_a_bounded_rate(caplog):
    counter = SkipCounter(first_warnings=2, then_every_seconds=3600)
    with caplog.at_level("WARNING", logger="vldist.data"):
        counter(MissingSamples("a.tar holds 3 of the 10 samples", 7, "/d/a.tar"))
        counter(ValueError("bad npy"), shard="/d/b.tar")
        counter(ValueError("bad npy"), shard="/d/b.tar")
        counter(ValueError("no shard known"))
    count, reasons, by_shard = counter.take()
    assert (count, by_shard) == (10, {"/d/a.tar": 7, "/d/b.tar": 2})
    assert len(reasons) == 3 and counter.take() == (0, [], {})
    warned = [r.getMessage() for r in caplog.records]
    assert warned[0].startswith("skipping 7 samples of a damaged shard #7: a.tar holds 3")
    assert warned[1].startswith("skipping corrupt sample #8: ValueError: bad npy")
    assert len(warned) == 2  # the rest within the rate's bound: counted, not shown


def _keyed(raw, rng):
    return {"key": raw["__key__"]}


def _collate(samples):
    return {"keys": [s["key"] for s in samples]}


def _exact_passes(urls, listed, world, workers, batch_size=8, samples=200):
    """Each rank's batches of one exact epoch (skip reports folded as the trainer folds them), and
    every rank's trailing skips."""
    per_rank, trailing = [], SkipReport()
    for rank in range(world):
        spec = StreamSpec(
            urls=urls,
            keep=("json",),
            sample_fn=_keyed,
            collate_fn=_collate,
            batch_size=batch_size,
            seed=3,
            rank=rank,
            world_size=world,
            listed=listed,
        )
        folded = _SkipsFolded(make_loader(ExactEpochStream(spec, samples, shuffle_buffer=20), workers))
        per_rank.append(list(folded))
        trailing.add(folded.trailing)
    return per_rank, trailing


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 2), (3, 1)])
def test_an_exact_epoch_over_a_cut_shard_ends_at_one_batch_on_every_rank_counting_each_lost_sample_once(
    planted_shards, tmp_path, world, workers
):
    shards, whole = cut_shard_copy(planted_shards, tmp_path / "set", _at_a_boundary)
    opened = ShardSet.open(shards)
    urls = opened.urls("train")
    per_rank, trailing = _exact_passes(urls, listed_counts(opened.manifest, "train", urls), world, workers)
    readable = 150 + whole
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, [len(b) for b in per_rank]  # no rank takes a step the others do not
    steps = counts.pop()
    assert steps < exact_epoch_steps(200, 8 * world, world)  # the epoch ran out early...
    keys = [k for batches in per_rank for b in batches for k in b["keys"]]
    assert len(keys) == len(set(keys))  # ...every sample at most once...
    global_batch = 8 * world
    kept_whole = readable // global_batch * global_batch
    rest = readable - kept_whole  # the global batch cut short: kept if every rank holds a row of it
    kept = readable if rest > (world - 1) * 8 else kept_whole
    assert len(keys) == kept
    skipped = sum(b["skipped"] for batches in per_rank for b in batches) + trailing.count
    assert skipped == 200 - kept  # ...and every sample the epoch lost counted once, whatever the ranks and workers


def test_the_cut_short_last_batch_is_dropped_when_a_rank_would_have_no_row(planted_shards, tmp_path):
    """161 readable samples, 2 ranks x 8: the last global batch has one row, which only rank 0 would
    hold; it is skipped and counted on both, so both take 10 steps."""
    shards, whole = cut_shard_copy(planted_shards, tmp_path / "set", lambda shard, ends: ends[10])
    assert 150 + whole == 161
    opened = ShardSet.open(shards)
    urls = opened.urls("train")
    per_rank, trailing = _exact_passes(urls, listed_counts(opened.manifest, "train", urls), world=2, workers=0)
    assert [len(b) for b in per_rank] == [10, 10]
    skipped = sum(b["skipped"] for batches in per_rank for b in batches) + trailing.count
    assert skipped == 40  # 39 lacking, 1 dropped with its cut-short batch


def test_skip_reports_alone_are_folded_into_the_next_batch_and_the_last_kept():
    reports = [
        {"skipped": 2, "skip_reasons": ["x"], "skipped_by_shard": {"a": 2}, "only_skips": True},
        {"keys": [1], "skipped": 1, "skipped_by_shard": {"b": 1}},
        {"keys": [2], "skipped": 0, "skipped_by_shard": {}},
        {"skipped": 5, "skip_reasons": [], "skipped_by_shard": {"a": 5}, "only_skips": True},
    ]
    folded = _SkipsFolded(iter(reports))
    batches = list(folded)
    assert [b["keys"] for b in batches] == [[1], [2]]
    assert (batches[0]["skipped"], batches[0]["skipped_by_shard"]) == (3, {"b": 1, "a": 2})
    assert (folded.trailing.count, folded.trailing.by_shard) == (5, {"a": 5})


class _FailingOn:
    """A sample function that cannot decode the given keys (module level: workers get it pickled)."""

    def __init__(self, keys):
        self.keys = set(keys)

    def __call__(self, raw, rng):
        if raw["__key__"] in self.keys:
            raise ValueError(f"cannot decode {raw['__key__']}")
        return {"key": raw["__key__"]}


def _exact_stream(urls, sample_fn, rank, world):
    spec = StreamSpec(
        urls=urls, keep=("json",), sample_fn=sample_fn, collate_fn=_collate, batch_size=8, rank=rank, world_size=world
    )
    return ExactEpochStream(spec, 200, shuffle_buffer=20)


def test_a_rank_that_can_decode_none_of_its_rows_ends_the_run_and_alone_the_batch_is_left_out(planted_shards):
    from vldist.errors import UnreadableBatch

    urls = ShardSet.open(planted_shards).urls("train")
    first = next(iter(make_loader(_exact_stream(urls, _keyed, rank=1, world=2), 0)))["keys"]
    with pytest.raises(UnreadableBatch, match="none of rank 1's samples of batch 1 could be read"):
        list(make_loader(_exact_stream(urls, _FailingOn(first), rank=1, world=2), 0))
    # rank 0's rows are other samples: it is not the one without a batch
    assert len(list(make_loader(_exact_stream(urls, _FailingOn(first), rank=0, world=2), 0))) == 13
    # one process has no rank to keep in step with: the batch is left out and its samples counted
    alone = next(iter(make_loader(_exact_stream(urls, _keyed, rank=0, world=1), 0)))["keys"]
    folded = _SkipsFolded(make_loader(_exact_stream(urls, _FailingOn(alone), rank=0, world=1), 0))
    batches = list(folded)
    assert len(batches) == 24 and batches[0]["skipped"] == 8 and batches[0]["keys"] != alone
