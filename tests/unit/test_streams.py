"""A job's training streams: the micro-batches of an epoch, the streams taking turns step by step
(each as many steps as its own epoch, or paced by another's), and the checks on their batches."""

import pytest

from vldist.data.job_shards import JobShards
from vldist.data.shardset import ShardSet
from vldist.data.streams import StreamSource, TrainingStreams
from vldist.recipes.jobs import load_config


class Streams:
    """The recipe parts TrainingStreams reads; each batch says which stream and samples it holds."""

    sample_keys, optional_keys = ("json",), ()
    streams: dict = {}

    @classmethod
    def train_streams(cls, config):
        return cls.streams

    def stream_functions(self, name):
        return (lambda raw, rng: {"key": raw["__key__"]}), (lambda samples: {"keys": [s["key"] for s in samples]})


def streams(planted_shards, sources, *overrides, rank=0, world_size=1, accumulation=1):
    config = load_config(
        "vsrn",
        [f"data.shards={planted_shards}", "data.batch_size=32", "data.shuffle_buffer=10", "data.workers=0", *overrides],
    )
    Streams.streams = sources
    return TrainingStreams(config, Streams(), JobShards(ShardSet.open(planted_shards)), rank, world_size, accumulation)


def test_streams_take_turns_until_each_has_had_its_epoch(planted_shards):
    # 200 train samples / 32 = 7 steps; 40 val samples / 32 = 2
    training = streams(planted_shards, {"a": "train", "b": "val"})
    assert training.micro_per_epoch == 9
    order = [batch["stream"] for batch in training.batches(0)]
    assert order == ["a", "b", "a", "b", *["a"] * 5]


def test_a_paced_stream_takes_the_steps_of_another_and_its_own_batch(planted_shards):
    training = streams(planted_shards, {"a": "train", "b": StreamSource("val", batch_size=8, steps_like="a")})
    batches = list(training.batches(0))
    assert training.micro_per_epoch == 14 and [b["stream"] for b in batches] == ["a", "b"] * 7
    assert {len(b["keys"]) for b in batches if b["stream"] == "b"} == {8}


def test_micro_batches_of_a_step_share_a_stream_and_ranks_take_their_share(planted_shards):
    training = streams(planted_shards, {"a": "train", "b": "val"}, rank=1, world_size=2, accumulation=2)
    batches = list(training.batches(0))
    assert [b["stream"] for b in batches][:4] == ["a", "a", "b", "b"]
    assert {len(b["keys"]) for b in batches} == {8}  # 32 / 2 ranks / 2 micro-batches


def test_the_epoch_decides_the_draws(planted_shards):
    training = streams(planted_shards, {"a": "train"})
    first, again, second = ([b["keys"] for b in training.batches(e)] for e in (0, 0, 1))
    assert first == again != second


@pytest.mark.parametrize(
    "sources, overrides, match",
    [
        ({"a": "train", "b": "val"}, ["data.resampled=false"], "data.resampled=false reads one stream"),
        ({"a": StreamSource("train", batch_size=30)}, [], "its batch of 30 must be divisible"),
        ({"a": StreamSource("train", steps_like="b")}, [], "takes its steps like 'b'"),
    ],
)
def test_streams_that_cannot_be_read_say_why(planted_shards, sources, overrides, match):
    with pytest.raises(ValueError, match=match):
        streams(planted_shards, sources, *overrides, world_size=4)
