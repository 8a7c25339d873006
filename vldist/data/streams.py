"""The training streams of a job: which shard sets and splits a recipe trains on, how many batches
each rank takes per epoch, and the epoch's batches with the streams taking turns.

A recipe names its streams (`Recipe.train_streams`: a split of the job's set, or a StreamSource);
this module turns them into resampled streams (data/pipeline.py) for one rank, counts the
micro-batches of an epoch, and yields an epoch's batches, one optimizer step of each stream in
turn (L2C: a batch of image pairs, then one of single-image captions), each tagged with its
stream's name in batch["stream"].

The loaders are built once and keep their workers from epoch to epoch (the epoch reaches them
through the streams' SharedEpoch): once an epoch's last batch is taken, the next epoch's pass
begins at once, so the workers fill their shuffle buffers while the trainer validates and saves.

A pass can begin at any step of its epoch (a resumed run's data position). Over indexed shards
(data/indexed_stream.py) the streams begin there and read nothing before it; a set without an
index is read from the epoch's start and the batches before the position dropped, as it always
was, and the log says once how to index it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from vldist.data.indexed_stream import IndexedSource, IndexedStream
from vldist.data.pipeline import (
    ExactEpochStream,
    Loader,
    StreamSpec,
    TrainStream,
    batches_per_rank,
    exact_epoch_steps,
    make_loader,
)
from vldist.data.shard_stream import listed_counts
from vldist.store.location import redact

log = logging.getLogger("vldist.data")


@dataclass(frozen=True)
class StreamSource:
    """Where a training stream reads, when that is more than a split of the job's shard set
    (L2C: image pairs from one set, 16 a step; single-image captions from another, 128 a step)."""

    split: str
    shards: str | None = None  # another shard set's directory (None: data.shards)
    batch_size: int | None = None  # this stream's global batch (None: data.batch_size)
    keys: tuple[str, ...] | None = None  # tar members it needs (None: the recipe's sample_keys)
    steps_like: str | None = None  # take as many steps an epoch as this other stream (None: its own epoch)


def stream_sources(streams: dict[str, str | StreamSource]) -> dict[str, StreamSource]:
    """A recipe's train_streams() with plain splits as StreamSources."""
    return {name: src if isinstance(src, StreamSource) else StreamSource(src) for name, src in streams.items()}


class TrainingStreams:
    """One rank's training streams of a job. `micro_per_epoch`: the micro-batches this rank takes
    in an epoch (every stream's, together); `batches(epoch, step)`: that epoch's micro-batches from
    a step on.

    shards: a JobShards (data/job_shards.py), each set opened once; recipe: its train_streams(),
    stream_functions() and sample_keys; accumulation: micro-batches per optimizer step. close()
    ends the loaders' workers (an epoch left unfinished ends them too, and so does the process's end).
    """

    def __init__(self, config, recipe, shards, rank: int, world_size: int, accumulation: int = 1, shielded_signals=()):
        self.config, self.accumulation, self.shielded = config, accumulation, tuple(shielded_signals)
        self.global_micro: dict[str, int] = {}  # each stream's micro-batch across all ranks
        self.exact_samples: int | None = None  # an exact epoch's samples (data.resampled=false)
        self.streams, self.counts = self._build(recipe, shards, rank, world_size)
        self.micro_per_epoch = sum(self.counts.values())  # micro-batches per epoch, by stream
        self.loaders: dict[str, Loader] = {}  # built at the first epoch, kept until close()
        self.begun: int | None = None  # the epoch whose pass the loaders have begun ahead of batches()
        # the last pass: whether its streams ran out before the epoch's planned batches (samples the
        # shards lack, in an exact epoch), and the skips they reported after their last batch
        self.ran_out = False
        self.trailing_skips = SkipReport()
        # the run's length in optimizer steps and epochs (the trainer's too): no pass is begun beyond the last
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / accumulation)
        self.total_steps = config.train.max_steps or config.train.epochs * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        # the samples an epoch takes, every rank's: what data.max_skipped_fraction is a share of
        self.planned_samples = self.exact_samples or sum(self.counts[n] * self.global_micro[n] for n in self.counts)

    def _build(self, recipe, shards, rank: int, world_size: int) -> tuple[dict, int]:
        config, t = self.config, self.config.train
        sources = stream_sources(recipe.train_streams(config))
        if len(sources) > 1 and not config.data.resampled:
            raise ValueError(
                f"data.resampled=false reads one stream; this recipe has {len(sources)} ({', '.join(sources)})"
            )
        specs, counts, streams = {}, {}, {}
        for index, (name, src) in enumerate(sources.items()):
            shard_set = shards.get(src.shards)
            batch = src.batch_size or config.data.batch_size
            if batch % (world_size * self.accumulation):
                raise ValueError(
                    f"stream '{name}': its batch of {batch} must be divisible by {world_size} "
                    f"ranks x train.grad_accumulation={self.accumulation}"
                )
            micro_global = batch // self.accumulation
            self.global_micro[name] = micro_global
            indexed = self._indexed_sources(config, shards, shard_set, src)
            samples = t.samples_per_epoch or (
                sum(sum(s.counts) for s in indexed) if indexed else shard_set.num_samples(src.split)
            )
            if samples is None:
                raise ValueError(
                    f"the shard set has no manifest count for split '{src.split}'; set train.samples_per_epoch"
                )
            sample_fn, collate_fn = recipe.stream_functions(name)
            specs[name] = StreamSpec(
                urls=[url for s in indexed for url in s.urls] if indexed else shard_set.urls(src.split),
                keep=src.keys or recipe.sample_keys,
                sample_fn=sample_fn,
                collate_fn=collate_fn,
                batch_size=micro_global // world_size,
                seed=config.seed + 1_000_003 * index,
                rank=rank,
                world_size=world_size,
                optional=recipe.optional_keys,
                access=shard_set.access,
                listed={} if indexed else listed_counts(shard_set.manifest, src.split, shard_set.urls(src.split)),
            )
            if not config.data.resampled:  # one stream; the last step of an exact epoch may take fewer micro-batches
                self.exact_samples = samples
                if indexed:
                    stream = IndexedStream(specs[name], indexed, config.data.shuffle_buffer, True, samples)
                    return {name: stream}, {name: stream.batches}
                steps = exact_epoch_steps(samples, micro_global, world_size)
                return {name: ExactEpochStream(specs[name], samples, config.data.shuffle_buffer)}, {name: steps}
            counts[name] = batches_per_rank(samples, batch) * self.accumulation
            if indexed:
                streams[name] = IndexedStream(
                    specs[name], indexed, config.data.shuffle_buffer, False, batches=counts[name]
                )
        own = dict(counts)
        for name, src in sources.items():
            if src.steps_like is not None:  # e.g. one single-image batch per pair batch, as L2C trains
                if src.steps_like not in own or src.steps_like == name:
                    raise ValueError(
                        f"stream '{name}' takes its steps like '{src.steps_like}', which is not another "
                        f"of this recipe's streams ({', '.join(sources)})"
                    )
                counts[name] = own[src.steps_like]
                if name in streams:
                    streams[name].batches = counts[name]
        for name in specs:
            if name not in streams:
                streams[name] = TrainStream(specs[name], counts[name], config.data.shuffle_buffer)
        return streams, counts

    @staticmethod
    def _indexed_sources(config, shards, shard_set, src: StreamSource) -> list[IndexedSource] | None:
        """What an indexed stream reads: data.sources for the stream of data.shards when they are
        set (each must be indexed), else the stream's own set; None for a set without an index
        (said once, with how to index it)."""
        if config.data.sources and src.shards in (None, config.data.shards):
            out = []
            for source in config.data.sources:
                each = shards.get(source.shards)
                indexes = each.sample_indexes(src.split)
                if indexes is None:
                    raise ValueError(
                        f"data.sources reads only indexed shard sets, and {redact(source.shards)} has no sample index: "
                        f"index it with `python -m vldist.shards index {redact(source.shards)}`"
                    )
                out.append(IndexedSource(source.label, each.urls(src.split), indexes, each.access, source.weight))
            return out
        indexes = shard_set.sample_indexes(src.split)
        if indexes is None:
            log.warning(
                "the shard set %s has no sample index: an exact epoch makes every rank read every shard, and a "
                "resumed run reads its epoch up to the position it resumes at. Index it once with "
                '`python -m vldist.shards index %s` (docs/distributed.md, "Data across ranks")',
                redact(shard_set.directory),
                redact(shard_set.directory),
            )
            return None
        return [IndexedSource(src.split, shard_set.urls(src.split), indexes, shard_set.access)]

    def source_names(self) -> list[str]:
        """The weighted sources whose per-step counts the batches carry (data.sources), in order."""
        return [
            s.name
            for stream in self.streams.values()
            if isinstance(stream, IndexedStream) and len(stream.sources) > 1
            for s in stream.sources
        ]

    @functools.cached_property
    def _schedule(self) -> list[tuple[str, int]]:
        left = {name: self.counts[name] for name in self.streams}
        steps = []
        while any(left.values()):
            for name in left:
                if left[name]:
                    take = min(self.accumulation, left[name])
                    steps.append((name, take))
                    left[name] -= take
        return steps

    def schedule(self) -> list[tuple[str, int]]:
        """An epoch's optimizer steps: (the stream, its micro-batches), streams taking turns."""
        return self._schedule

    def positions(self, step: int) -> dict[str, int]:
        """Each stream's micro-batches taken once `step` steps of an epoch are done."""
        taken = dict.fromkeys(self.streams, 0)
        for name, micro in self.schedule()[:step]:
            taken[name] += micro
        return taken

    def data_position(self, epoch: int, step: int) -> dict:
        """What a checkpoint records of where the data stands after `step` steps of `epoch`: with
        it, and the seed, every stream's next batch is known (their draws are counter-based:
        data/epoch_order.py), so no generator state or buffer needs to be kept."""
        taken = self.positions(step)
        return {
            "epoch": epoch,
            "step": step,
            "samples": {name: taken[name] * self.global_micro[name] for name in self.streams},
            "indexed": all(isinstance(s, IndexedStream) for s in self.streams.values()),
        }

    def batches(self, epoch: int, step: int = 0, loader: Callable = make_loader) -> Iterator[dict]:
        """This epoch's micro-batches from step `step` on, tagged with their stream; streams take
        turns step by step. Close the iterator (contextlib.closing) once done with it: closed before
        the epoch's last batch was taken (an exception, a stop, the run's last step), it ends the
        loaders' workers at once; after it, the next epoch's pass begins (the last epoch's end ends
        the workers)."""
        if self.begun != (epoch, step):
            self.begin(epoch, step, loader)
        self.begun = None
        self.ran_out, self.trailing_skips = False, SkipReport()
        passes = {name: _SkipsFolded(self.loaders[name]) for name in self.streams}
        reached = self.positions(step)
        for name, stream in self.streams.items():  # a set without an index: read up to the position
            if not isinstance(stream, IndexedStream):
                for _ in range(reached[name]):
                    next(passes[name], None)
        remaining = self.schedule()[step:]
        due, taken = sum(micro for _, micro in remaining), 0
        try:
            for name, micro in remaining:
                for _ in range(micro):
                    batch = next(passes[name], None) if name in passes else None
                    if batch is None:  # a stream with no more readable samples
                        self.ran_out = True
                        self.trailing_skips.add(passes.pop(name).trailing)
                        break
                    batch["stream"] = name
                    taken += 1
                    yield batch
        finally:
            if taken < due and passes:
                self.close()  # here, not in a finalizer, where a Ctrl-C that comes meanwhile is lost
            elif epoch + 1 < self.epochs:
                self.begin(epoch + 1)  # read ahead while the trainer validates and checkpoints
            else:
                self.close()  # the run's last epoch: its workers are done
            for unfinished in passes.values():
                unfinished.close()  # a pass that a later one replaced leaves the workers be

    def begin(self, epoch: int, step: int = 0, loader: Callable = make_loader) -> None:
        """Begin the epoch's pass at step `step` now, so that the workers start and fill their
        buffers while the trainer does something else (evaluates the untrained model);
        batches(epoch, step) then takes it over. Another pass, begun before, is dropped."""
        if not self.loaders:
            workers = self.config.data.workers
            self.loaders = {
                name: loader(s, workers, self.shielded, persistent=True) for name, s in self.streams.items()
            }
        positions = self.positions(step)
        for name, stream in self.streams.items():
            stream.epoch = epoch
            if isinstance(stream, IndexedStream):
                stream.first_batch = positions[name]
        for name in self.streams:
            self.loaders[name].start()
        self.begun = (epoch, step)

    def close(self) -> None:
        """End the loaders' workers now (a later epoch starts new ones)."""
        for each in self.loaders.values():
            each.close()
        self.loaders, self.begun = {}, None


@dataclass
class SkipReport:
    """Samples skipped, with the count of each shard they came from (where known)."""

    count: int = 0
    by_shard: dict[str, int] = field(default_factory=dict)

    def add(self, other: SkipReport) -> None:
        self.count += other.count
        for shard, n in other.by_shard.items():
            self.by_shard[shard] = self.by_shard.get(shard, 0) + n

    def add_batch(self, batch: dict) -> None:
        """Take a batch's skip report off it (pipeline._collate) into this one."""
        batch.pop("skip_reasons", None)  # the warnings have shown them
        self.add(SkipReport(batch.pop("skipped", 0), batch.pop("skipped_by_shard", {})))


class _SkipsFolded:
    """A pass's batches, with the reports of skips alone (pipeline._skips_alone: a worker's skips
    after its last batch, or a batch left out) folded into the next batch; those after the last
    batch are kept in `trailing`."""

    def __init__(self, batches):
        self._batches = iter(batches)
        self.trailing = SkipReport()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        for batch in self._batches:
            if not batch.pop("only_skips", False):
                batch["skipped"] = batch.get("skipped", 0) + self.trailing.count
                by_shard = batch.setdefault("skipped_by_shard", {})
                for shard, n in self.trailing.by_shard.items():
                    by_shard[shard] = by_shard.get(shard, 0) + n
                self.trailing = SkipReport()
                return batch
            self.trailing.add_batch(batch)
        raise StopIteration

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
