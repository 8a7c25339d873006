"""Training streams over indexed shards: each rank reads only its own samples, and a pass can begin
at any batch without reading the ones before it.

Batch k of an epoch is a function of (seed, epoch, k, rank) alone (data/epoch_order.py):

- exact (data.resampled=false): global batch k is positions [k*G, (k+1)*G) of the epoch's global
  order, G the global micro-batch; the rank takes its rows of it (rank_rows) and fetches only
  those. Every sample once per epoch, equal steps on every rank, for any number of ranks: a run
  resumed on W' ranks gets the rest of the epoch dealt to its W' ranks.
- resampled: batch k of rank r is positions [k*b, (k+1)*b) of rank r's draws.

A worker takes batches first+w, first+w+workers, ... (the DataLoader takes them from its workers
in turn, so they arrive in order), so the batches do not depend on the number of workers either.
Each sample's own random generator (the recipe's caption choice) is seeded by its position, and
the global generators a recipe may draw from (torchvision's augmentations draw from torch's) by the
batch's, so a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from vldist.data.epoch_order import ExactOrder, ResampledOrder, rank_rows
from vldist.data.mixture import Mixture
from vldist.data.pipeline import (
    SharedEpoch,
    StreamSpec,
    _collate,
    _EpochStream,
    _prepared,
    _seed,
    _skipped_unless_a_shard_is_lost,
    _worker,
    exact_epoch_steps,
    member_suffixes,
    seed_global_generators,
)
from vldist.data.sample_index import ShardIndex, one_sample, tar_samples
from vldist.data.sample_reader import read_shards
from vldist.data.skips import skipped
from vldist.errors import UnreadableBatch
from vldist.store.access import StoreAccess

REDRAWS = 8  # resampled: times an unreadable row is drawn again before it is left out


class IndexMismatch(ValueError):
    """A sample's bytes are not the sample its index names: the index is stale."""


@dataclass
class IndexedSource:
    """One indexed shard set a stream reads: the split's shards and their indexes; `weight`: its
    share of the stream's samples among several sources (data.sources)."""

    name: str
    urls: list[str]
    indexes: list[ShardIndex]
    access: StoreAccess = field(default_factory=StoreAccess)
    weight: float = 1.0

    @property
    def counts(self) -> list[int]:
        return [len(i) for i in self.indexes]


class IndexedStream(_EpochStream):
    """One rank's training batches over indexed sources; `exact` chooses the order (module
    docstring). `samples`: an exact epoch's length (default: every sample of every source);
    `batches`: a resampled epoch's batches per rank. With several sources each position of the
    stream draws from the source data/mixture.py gives it; a source drawn more often than it has
    samples in an exact epoch is read again in a new order, one drawn less gives its first samples."""

    def __init__(
        self,
        spec: StreamSpec,
        sources: list[IndexedSource],
        shuffle_buffer: int,
        exact: bool,
        samples: int | None = None,
        batches: int | None = None,
    ):
        super().__init__()
        self.spec, self.sources, self.shuffle_buffer, self.exact = spec, sources, shuffle_buffer, exact
        self.mixture = Mixture([s.weight for s in sources])
        total = sum(sum(s.counts) for s in sources)
        # one source: at most its samples; several: any length (a source may be read more than once)
        self.samples = min(samples or total, total) if len(sources) == 1 else samples or total
        global_batch = spec.batch_size * spec.world_size
        self.batches = exact_epoch_steps(self.samples, global_batch, spec.world_size) if exact else batches
        self._first = SharedEpoch()  # the batch a pass begins at: set with the epoch before each pass

    @property
    def first_batch(self) -> int:
        return self._first.get()

    @first_batch.setter
    def first_batch(self, value: int) -> None:
        self._first.set(value)

    def _orders(self, epoch: int):
        """Each source's order this epoch: source position -> (shard, row)."""
        if not self.exact:
            return [
                ResampledOrder(s.counts, self.spec.seed + i, epoch, self.spec.rank, self.shuffle_buffer)
                for i, s in enumerate(self.sources)
            ]
        return [_Rounds(s.counts, self.spec.seed + i, epoch, self.shuffle_buffer) for i, s in enumerate(self.sources)]

    def positions(self, batch: int) -> range:
        """This rank's positions in the stream for batch `batch`."""
        b, world = self.spec.batch_size, self.spec.world_size
        if not self.exact:
            return range(batch * b, (batch + 1) * b)
        start = batch * b * world
        rows = rank_rows(min(b * world, self.samples - start), world, self.spec.rank)
        return range(start + rows.start, start + rows.stop)

    def __iter__(self) -> Iterator[dict]:
        worker, workers = _worker()
        epoch, first = self.epoch, self.first_batch  # read once, as the pass begins
        orders = self._orders(epoch)
        handler = _skipped_unless_a_shard_is_lost if self.exact else skipped
        for batch in range(first + worker, self.batches, workers):
            where = self.positions(batch)
            seed_global_generators(_seed(self.spec.seed, epoch, batch, self.spec.rank, 2))
            draws = self.mixture.draws(where.start, where.stop)
            rows = self._prepared_rows(draws, orders, epoch, handler)
            # resampled: a row that cannot be read is drawn again further along its source's draws,
            # past the epoch's (deterministic, so a resumed run redraws alike), a few times at most
            stride = self.batches * self.spec.batch_size
            for attempt in range(1, 0 if self.exact else REDRAWS + 1):
                missing = [i for i, row in enumerate(rows) if row is None]
                if not missing:
                    break
                again = [(draws[i][0], draws[i][1] + attempt * stride) for i in missing]
                for i, row in zip(missing, self._prepared_rows(again, orders, epoch, handler), strict=True):
                    rows[i] = row
            prepared = [row for row in rows if row is not None]
            if not prepared:
                raise UnreadableBatch(
                    f"none of rank {self.spec.rank}'s {len(draws)} samples of batch {batch + 1} of epoch {epoch + 1} "
                    "could be read (the warnings above say why), and a rank without a batch would put the ranks out "
                    "of step; the checkpoints written before are whole. Check the set with `python -m vldist.shards "
                    "verify`, then carry on with train.resume=latest"
                )
            collated = _collate(self.spec, [out for out, _ in prepared])
            if len(self.sources) > 1:
                by_source = [0] * len(self.sources)
                for _, source in prepared:
                    by_source[source] += 1
                collated["source_counts"] = dict(zip((s.name for s in self.sources), by_source, strict=True))
            yield collated

    def _prepared_rows(self, draws, orders, epoch: int, handler) -> list[tuple[dict, int] | None]:
        """Each (source, position)'s recipe sample and source, or None where it could not be read or
        decoded (skipped and counted)."""
        samples = self._read([(source, *orders[source].sample(p)) for source, p in draws], handler)
        rank = () if self.exact else (self.spec.rank,)
        rows: list[tuple[dict, int] | None] = []
        for (source, p), raw in zip(draws, samples, strict=True):
            out = None
            if raw is not None:
                rng = random.Random(_seed(self.spec.seed, epoch, source, p, *rank))
                try:
                    out = _prepared(self.spec, raw, rng)
                except Exception as exn:  # noqa: BLE001 - a corrupt sample: skipped and counted
                    skipped(exn, shard=raw.get("__url__"))
            rows.append(None if out is None else (out, source))
        return rows

    def _read(self, wanted: list[tuple[int, int, int]], handler) -> list[dict | None]:
        """The raw samples at (source, shard, row), in that order; None for one that could not be
        read (the handler counted it, or raised: a lost shard ends an exact epoch)."""
        rows_of: dict[tuple[int, int], list[int]] = {}
        for source, shard, row in wanted:
            rows_of.setdefault((source, shard), []).append(row)
        read: dict[tuple[int, int, int], dict | None] = {}
        members = member_suffixes(self.spec)
        groups = list(rows_of.items())
        requests = []
        for (source, shard), rows in groups:
            src = self.sources[source]
            requests.append((src.urls[shard], [src.indexes[shard].span(r) for r in rows], src.access))
        try:
            data = read_shards(requests)
        except Exception:  # noqa: BLE001 - one shard failed: read each alone, so that the others are kept
            data = [self._read_one(request, handler) for request in requests]
        for ((source, shard), rows), chunks in zip(groups, data, strict=True):
            url, index = self.sources[source].urls[shard], self.sources[source].indexes[shard]
            for row, chunk in zip(rows, chunks or [None] * len(rows), strict=True):
                read[(source, shard, row)] = (
                    None if chunk is None else _one_sample(chunk, url, index.keys[row], members)
                )
        return [read[w] for w in wanted]

    @staticmethod
    def _read_one(request, handler) -> list[bytes] | None:
        """One shard's spans; None when it cannot be read (the handler counted it, or raised)."""
        try:
            return read_shards([request])[0]
        except Exception as exn:  # noqa: BLE001 - the handler decides (count and skip, or stop)
            exn.args = exn.args + (request[0],)
            exn.shard = request[0]
            handler(exn)
            return None


class _Rounds:
    """An exact source's samples at any position of an epoch: its epoch order, and after its last
    sample (a source drawn more often than it has samples) the order of another round."""

    def __init__(self, counts: list[int], seed: int, epoch: int, window: int):
        self.counts, self.seed, self.epoch, self.window = counts, seed, epoch, window
        self.size = sum(counts)
        self._orders: dict[int, ExactOrder] = {}

    def sample(self, position: int) -> tuple[int, int]:
        round_, within = divmod(position, self.size)
        if round_ not in self._orders:
            self._orders[round_] = ExactOrder(self.counts, self.seed, self.epoch, self.window, round_)
        return self._orders[round_].sample(within)


def _one_sample(data: bytes, url: str, key: str, wanted: tuple[str, ...]) -> dict | None:
    """The raw sample in `data` holding the members the recipe reads, or None (skipped and
    counted) if the bytes are not the sample `key` the index names."""
    try:
        sample = one_sample(data, url)
        found = [sample] if sample is not None else list(tar_samples(data, url, _reraise))
        if len(found) != 1 or found[0].get("__key__") != key:
            raise IndexMismatch(
                f"the bytes the index gives for sample {key!r} of {url} hold "
                f"{[s.get('__key__') for s in found]}: the index is stale; rebuild it with "
                "`python -m vldist.shards index <the set>`"
            )
    except Exception as exn:  # noqa: BLE001 - a corrupt sample: skipped and counted
        skipped(exn, shard=url)
        return None
    return {k: v for k, v in found[0].items() if k.startswith("__") or ("." + k).endswith(wanted)}


def _reraise(exn: BaseException) -> bool:
    raise exn
