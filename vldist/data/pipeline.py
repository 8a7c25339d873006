"""Streaming loaders over WebDataset shards.

Training streams shards with resampling (open_clip's approach): every rank and every worker draws
shards at random, seeded by (seed, rank, worker, epoch), so each yields exactly the number of
batches asked for, whatever the shard count. That is what keeps distributed ranks in step.
Evaluation reads every sample of a split once, in shard order.

A loader can keep its workers between passes (make_loader(persistent=True)): a training stream
reads its epoch from shared memory (SharedEpoch) when a pass begins, so the workers need no
restart, and each pass yields what a fresh loader would, to the sample.

The recipe supplies the per-sample transform and the collate function; this module knows nothing
about what a sample holds beyond the tar member names it is told to keep.
"""

from __future__ import annotations

import atexit
import functools
import gc
import math
import multiprocessing
import multiprocessing.util  # its exit handler registered before this module's (_close_open_loaders)
import os
import random
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vldist.data.batch_handoff import packed, unpacked
from vldist.data.epoch_order import rank_rows
from vldist.data.identity import sample_identity
from vldist.data.shard_stream import shard_samples
from vldist.data.skips import MissingSamples, skipped
from vldist.distributed.orphans import die_with_parent
from vldist.errors import StoreLost, UnreadableBatch
from vldist.store.access import StoreAccess
from vldist.store.location import is_url
from vldist.store.retry import ShardLostInExactEpoch, ShardUnavailable
from vldist.training.stopping import ignore_in_worker, interrupts_deferred

SampleFn = Callable[[dict, random.Random], "dict | None"]
CollateFn = Callable[[list[dict]], dict]


@dataclass
class StreamSpec:
    urls: list[str]
    keep: tuple[str, ...]  # tar member extensions to read, e.g. ("json", "regions.npy")
    sample_fn: SampleFn  # raw tar sample -> recipe sample; raises on corrupt input
    collate_fn: CollateFn
    batch_size: int  # per rank
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    optional: tuple[str, ...] = ()  # members read when present (L2C: masks, which only some sets store)
    access: StoreAccess = field(default_factory=StoreAccess)  # how URLs are read: data.storage_options, data.retries
    # the samples each shard's manifest lists (shard_stream.listed_counts): a shard cut short is
    # found by its count, and the samples it lacks are counted as skipped
    listed: dict[str, int] = field(default_factory=dict)


def _seed(*parts: int) -> int:
    return hash(tuple(parts)) & 0x7FFF_FFFF


def _worker() -> tuple[int, int]:
    """(this worker, the loader's workers); in a worker, its global random generators are first set
    as torch sets a new worker's, so that a persistent worker's pass draws what a fresh worker's did
    (a recipe's sample function may use them)."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    seed_global_generators(info.seed, info.id)
    return info.id, info.num_workers


def seed_global_generators(seed: int, worker: int = 0) -> None:
    """Python's, torch's and numpy's global generators seeded as torch seeds a new worker's."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # as torch's worker loop seeds it (torch/utils/data/_utils/worker.py)
        from torch.utils.data._utils.worker import _generate_state

        numpy.random.seed(_generate_state(seed - worker, worker))


class SharedEpoch:
    """The epoch a stream reads, in shared memory: the trainer sets it before a pass, and workers
    that persist between passes read it when the pass begins (open_clip's SharedEpoch). Handed to
    workers when they start: inherited by forked ones, passed to a fork server's (no lock: one
    writer, and a pass begins only after the value is written)."""

    def __init__(self, epoch: int = 0):
        self._value = multiprocessing.Value("q", epoch, lock=False)

    def get(self) -> int:
        return int(self._value.value)

    def set(self, epoch: int) -> None:
        self._value.value = epoch


class _EpochStream(IterableDataset):
    """A stream whose order depends on `epoch`, which a persistent worker reads afresh each pass."""

    def __init__(self):
        self._epoch = SharedEpoch()

    @property
    def epoch(self) -> int:
        return self._epoch.get()

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.set(value)


def _raw(spec: StreamSpec, urls, handler=skipped) -> Iterator[dict]:
    """Undecoded samples of the given shards, holding only the members the recipe keeps."""
    wanted = member_suffixes(spec)
    return shard_samples(urls, handler, lambda n: n.endswith(wanted), spec.access, spec.listed)


def member_suffixes(spec: StreamSpec) -> tuple[str, ...]:
    """The endings of the tar members a stream reads (".json", ".regions.npy", ...)."""
    return tuple("." + k for k in (*spec.keep, *spec.optional))


def _skipped_unless_a_shard_is_lost(exn: BaseException) -> bool:
    """The exact epoch's handler: a corrupt sample is skipped and counted as anywhere, a shard lost
    after its retries ends the run (ShardLostInExactEpoch says why and what to do)."""
    _unless_a_shard_is_lost(exn)
    return skipped(exn)


def _unless_a_shard_is_lost(exn: BaseException) -> bool:
    """The same, counting nothing: for the readers of an exact epoch's shards other than the one
    that counts what the shards lack (every rank and worker reads the same bytes)."""
    if isinstance(exn, StoreLost):
        raise exn
    if isinstance(exn, ShardUnavailable):
        raise ShardLostInExactEpoch(
            f"{exn.args[0]}. An exact epoch (data.resampled=false) reads every shard on every rank in one order, "
            "and skipping this one would put the ranks' batches out of step, so the run ends here; the checkpoints "
            "written before are whole. Check the store, then carry on with train.resume=latest, or train with "
            "data.resampled=true, which skips a lost shard and goes on"
        ) from None
    return True


def _prepared(spec: StreamSpec, sample: dict, rng: random.Random) -> dict | None:
    """The recipe's sample of a raw one, with the raw sample's identity (data/identity.py) under
    "identity"; raises on corrupt input."""
    out = spec.sample_fn(sample, rng)
    if out is not None:
        out["identity"] = sample_identity(sample)
    return out


def _decoded(spec: StreamSpec, urls: Iterator[str], rng: random.Random) -> Iterator[dict]:
    """Samples of the given shards, corrupt ones skipped and counted."""
    return _decode_each(spec, _raw(spec, urls), rng)


def _decode_each(spec: StreamSpec, raw: Iterator[dict], rng: random.Random) -> Iterator[dict]:
    """The recipe's samples of raw ones, corrupt ones skipped and counted."""
    for sample in raw:
        try:
            missing = [k for k in spec.keep if k not in sample]
            if missing:
                raise KeyError(f"sample {sample.get('__key__')} in {sample.get('__url__')} lacks {missing}")
            out = _prepared(spec, sample, rng)
        except Exception as exn:  # noqa: BLE001 - any decode failure means a corrupt sample
            skipped(exn, shard=sample.get("__url__"))
            continue
        if out is not None:
            yield out


def _batches(spec: StreamSpec, samples: Iterator[dict], limit: int | None, partial: bool) -> Iterator[dict]:
    made = 0
    buf: list[dict] = []
    for sample in samples:
        buf.append(sample)
        if len(buf) == spec.batch_size:
            yield _collate(spec, buf)
            buf, made = [], made + 1
            if limit is not None and made >= limit:
                return
    if buf and partial:
        yield _collate(spec, buf)
    if partial and skipped.pending:  # skips after the last batch (or a shard with no good sample)
        yield _skips_alone()


def _skips_alone() -> dict:
    """A report of the skips since the last batch, with no samples."""
    count, reasons, by_shard = skipped.take()
    return {"skipped": count, "skip_reasons": reasons, "skipped_by_shard": by_shard, "only_skips": True}


def _collate(spec: StreamSpec, samples: list[dict]) -> dict:
    batch = spec.collate_fn(samples)
    # One identity per sample, in sample order: the losses never take two rows of one image as
    # each other's negatives (data/identity.py).
    batch["identity"] = torch.tensor([s["identity"] for s in samples], dtype=torch.long)
    batch["skipped"], batch["skip_reasons"], batch["skipped_by_shard"] = skipped.take()
    return packed(batch) if get_worker_info() is not None else batch  # small tensors in the pickle


class _ShardDraws:
    """Endless shard draws with replacement, which end once many draws in a row gave no readable
    sample: with every shard corrupt, drawing would otherwise never end (the trainer then reports
    an epoch without batches)."""

    def __init__(self, urls: list[str], rng: random.Random):
        self.urls, self.rng = urls, rng
        self.fruitless = 0  # draws since the last readable sample

    def __iter__(self) -> Iterator[str]:
        while self.fruitless <= 2 * len(self.urls) + 8:
            self.fruitless += 1
            yield self.rng.choice(self.urls)

    def count_readable(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            self.fruitless = 0
            yield sample


class TrainStream(_EpochStream):
    """An epoch of exactly `batches_per_rank` batches from resampled shards, shuffled in a buffer."""

    def __init__(self, spec: StreamSpec, batches_per_rank: int, shuffle_buffer: int):
        super().__init__()  # the epoch: set by the trainer before each pass
        self.spec = spec
        self.batches_per_rank = batches_per_rank
        self.shuffle_buffer = shuffle_buffer

    def __iter__(self) -> Iterator[dict]:
        worker, workers = _worker()
        epoch = self.epoch  # read once, as the pass begins
        # Share the rank's batches between its workers so the rank's total is exact.
        mine = self.batches_per_rank // workers + (worker < self.batches_per_rank % workers)
        if mine == 0:
            return
        rng = random.Random(_seed(self.spec.seed, self.spec.rank, worker, epoch))  # draws and shuffle
        sample_rng = random.Random(_seed(self.spec.seed, self.spec.rank, worker, epoch, 1))  # the recipe's
        draws = _ShardDraws(self.spec.urls, rng)
        raw = _raw(self.spec, iter(draws))
        if self.shuffle_buffer > 1:
            # The buffer holds raw bytes and only what it yields is decoded (as WebDataset's and
            # open_clip's pipelines do): what the buffer still holds when the rank's batches are
            # done was never decoded for nothing, and each epoch's first fill is bytes, not arrays.
            raw = wds.filters._shuffle(raw, bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)
        samples = draws.count_readable(_decode_each(self.spec, raw, sample_rng))
        yield from _batches(self.spec, samples, limit=mine, partial=False)


def exact_epoch_steps(samples: int, global_batch: int, world_size: int) -> int:
    """Steps of an exact epoch: every global batch, the last one too if each rank gets a row of it."""
    full, rest = divmod(samples, global_batch)
    return full + (rest >= world_size)


class ExactEpochStream(_EpochStream):
    """Every sample exactly once per epoch, across all ranks, with equal step counts.

    All ranks and workers read the same seeded global order (shards permuted per epoch, then a
    shuffle buffer with the same seed everywhere) and keep only their rows: rank r takes rows
    [r*b, (r+1)*b) of each global batch, and batch k of a rank is collated by worker k mod workers.
    The last, partial global batch is dealt out as evenly as possible (ranks may then hold one row
    more or less). If it has fewer rows than ranks it is skipped and counted. Every rank reads
    every shard (only its own samples are decoded): the price of exactness; use resampling at scale.

    Samples the shards lack (a shard cut short) are missing on every rank alike, since every rank
    reads the same bytes: the epoch then ends early, at the same batch everywhere. A rank hands
    over a batch only once the global batch's last row has gone by, so that a shard that ends
    within a batch ends it on every rank; a global batch cut short is kept if every rank holds a
    row of it, else skipped and counted (its rows are not re-dealt: the ranks decoded only their
    own). A rank none of whose rows of a batch could be decoded ends the run (UnreadableBatch):
    without a batch it would take one step fewer than the others.
    """

    def __init__(self, spec: StreamSpec, samples: int, shuffle_buffer: int):
        super().__init__()
        self.spec, self.samples, self.shuffle_buffer = spec, samples, shuffle_buffer

    def _planned(self, batch: int) -> int:
        """The rows of global batch `batch`, by the manifest's count."""
        global_batch = self.spec.batch_size * self.spec.world_size
        return min(global_batch, self.samples - batch * global_batch)

    def _my_rows(self, batch: int) -> range:
        """This rank's positions within global batch `batch`."""
        return rank_rows(self._planned(batch), self.spec.world_size, self.spec.rank)

    def __iter__(self) -> Iterator[dict]:
        worker, workers = _worker()
        b, world = self.spec.batch_size, self.spec.world_size
        steps = exact_epoch_steps(self.samples, b * world, world)
        epoch = self.epoch  # read once, as the pass begins
        rng = random.Random(_seed(self.spec.seed, epoch))  # the same on every rank and worker
        # what the shards lack is missing on every rank and worker alike: counted by one of them
        counts = self.spec.rank == 0 and worker == 0
        handler = _skipped_unless_a_shard_is_lost if counts else _unless_a_shard_is_lost
        raw = _raw(self.spec, rng.sample(self.spec.urls, len(self.spec.urls)), handler)
        if self.shuffle_buffer > 1:
            raw = wds.filters._shuffle(raw, bufsize=self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)
        sample_rng = random.Random(_seed(self.spec.seed, epoch, self.spec.rank))
        pending: list[dict] = []
        batch = row = -1
        for index, sample in enumerate(raw):
            batch, row = divmod(index, b * world)
            if batch >= steps:
                return
            mine = batch % workers == worker
            if mine and row in self._my_rows(batch):
                try:
                    prepared = _prepared(self.spec, sample, sample_rng)
                    if prepared is not None:
                        pending.append(prepared)
                except Exception as exn:  # noqa: BLE001 - a corrupt sample: skipped and counted
                    skipped(exn, shard=sample.get("__url__"))
            if row == self._planned(batch) - 1:  # the global batch is complete, on every rank alike
                if mine:
                    yield self._handed_over(pending, batch)
                pending = []
        cut_short = batch >= 0 and row != self._planned(batch) - 1 and batch % workers == worker
        # The shards ran out within global batch `batch` (they lack samples): it holds rows [0, row]
        if cut_short and row >= rank_rows(self._planned(batch), world, world - 1).start:  # each rank has a row
            yield self._handed_over(pending, batch)
        elif cut_short and pending:
            skipped(
                MissingSamples(
                    f"{len(pending)} samples of the epoch's last global batch, cut short to {row + 1} rows by the "
                    f"samples the shards lack: fewer rows than the {world} ranks",
                    len(pending),
                )
            )
        if skipped.pending:  # skips after this worker's last batch (a shard found short at its end)
            yield _skips_alone()

    def _handed_over(self, pending: list[dict], batch: int) -> dict:
        if pending:
            return _collate(self.spec, pending)
        if self.spec.world_size == 1:  # no other rank to keep in step with: the batch is left out
            return _skips_alone()
        raise UnreadableBatch(
            f"none of rank {self.spec.rank}'s samples of batch {batch + 1} could be read (the warnings above say "
            "why), and a rank without a batch would put the ranks out of step; the checkpoints written before are "
            "whole. Check the set with `python -m vldist.shards verify`, then carry on with train.resume=latest"
        )


class EvalStream(IterableDataset):
    """Every sample of the shards once, in order; shards are dealt out to ranks, then workers."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec

    def __iter__(self) -> Iterator[dict]:
        worker, workers = _worker()
        mine = self.spec.urls[self.spec.rank :: self.spec.world_size][worker::workers]
        rng = random.Random(_seed(self.spec.seed, self.spec.rank, worker))
        yield from _batches(self.spec, _decoded(self.spec, iter(mine), rng), limit=None, partial=True)


def batches_per_rank(samples_per_epoch: int, global_batch: int) -> int:
    """Optimizer steps in an epoch: the same on every rank."""
    return max(1, math.ceil(samples_per_epoch / global_batch))


def make_loader(stream: IterableDataset, workers: int, shielded_signals=(), persistent: bool = False) -> Loader:
    """`shielded_signals`: ignored by the workers (the stop signals: the trainer ends them itself).
    `persistent`: the workers stay from one pass to the next (Loader); otherwise each pass starts
    its own and ends them."""
    return Loader(functools.partial(_data_loader, stream, workers, tuple(shielded_signals), persistent), persistent)


def _data_loader(stream: IterableDataset, workers: int, shielded_signals: tuple, persistent: bool) -> DataLoader:
    # the start method is chosen as the workers start: a checkpoint store may have started
    # fsspec's IO thread since the last ones did
    start = _worker_start(stream, shielded_signals) if workers else None
    # a fork server's children have the environment of the server's start: hand them this one
    environment = dict(os.environ) if start is not None else None
    return DataLoader(
        stream,
        batch_size=None,  # the stream batches itself
        num_workers=workers,
        # Its own generator: drawing worker seeds from the global RNG would shift the model's
        # random stream (dropout) depending on when loaders are created, breaking exact resume.
        generator=torch.Generator().manual_seed(0),
        persistent_workers=persistent and workers > 0,  # each pass reads the stream's SharedEpoch afresh
        worker_init_fn=functools.partial(_init_worker, shielded_signals, environment) if workers else None,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=4 if workers else None,
        multiprocessing_context=start,
    )


def _init_worker(signals: tuple, environment: dict | None, worker_id: int) -> None:
    die_with_parent()  # no worker outlives the run, even one killed outright (distributed/orphans.py)
    # What the worker inherited (torch, the recipe, the trainer's objects: some 200,000) is never
    # garbage it made: frozen, the collections its samples' JSON and lists set off go through the
    # worker's own objects only (VSRN's workers: 27 against 32 ms of CPU a batch; docs/performance.md,
    # "The loader's workers and the garbage collector"), and they no longer write to the inherited
    # pages that fork shares copy-on-write.
    gc.freeze()
    if environment is not None:  # the store's credentials among them
        os.environ.clear()
        os.environ.update(environment)
    ignore_in_worker(signals, worker_id)


def _worker_start(stream: IterableDataset, shielded_signals: tuple = ()):
    """How loader workers start. fsspec's async stores (s3fs, gcsfs, HTTP) run an event loop in a
    thread and are not safe to fork (fsspec/s3fs#914): a worker forked while that thread is inside
    a request can wait forever on a lock it inherited held (seen: a 2-rank job from s3:// hung at
    an epoch's start). Where shards come from a store, or this process has started that thread (a
    checkpoint store), workers come from a fork server instead, which holds no such thread; plain
    fork otherwise, the fastest."""
    spec = getattr(stream, "spec", None)
    remote = spec is not None and any(is_url(url) for url in spec.urls)
    fsspec_async = sys.modules.get("fsspec.asyn")
    io_thread = getattr(fsspec_async, "iothread", [None])[0]
    if not remote and io_thread is None:
        return None
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    # Imported once, in the server, not again in every epoch's workers: what the stream calls, and
    # the main module, which each worker runs again (`python -m vldist.train`; Ray's worker script)
    main = getattr(sys.modules["__main__"], "__spec__", None)
    preload = [
        "torch",
        "webdataset",
        __name__,
        *([f.__module__ for f in (spec.sample_fn, spec.collate_fn)] if spec else []),
        *(["ray"] if "ray" in sys.modules else []),
        *([main.name] if main is not None else ["__main__"]),
    ]
    context.set_forkserver_preload(preload)
    # A stop signal sent to the whole process group (torchrun, Slurm) must not end the server or
    # its workers before they ignore it themselves: the server starts with them ignored, and its
    # children inherit that. (Signals can be set in the main thread only; a Ray worker's training
    # thread gets no group signals.)
    if threading.current_thread() is threading.main_thread() and shielded_signals:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in shielded_signals}
        try:
            forkserver.ensure_running()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return context


class Loader:
    """A DataLoader whose worker start, batch hand-over and worker shutdown Ctrl-C does not cut
    into: the KeyboardInterrupt comes between batches (preemption.interrupts_deferred).

    Each iteration is a pass over the stream. A persistent loader keeps its workers after a pass
    that ran to its end; a pass left unfinished (an exception, a stop, a partial read) ends them
    at once, as do close() and the end of the process, and the next pass starts new ones. start()
    begins the next pass ahead of its iteration, so that the workers read while the caller does
    something else (the trainer validates)."""

    _END = object()

    def __init__(self, make: Callable[[], DataLoader], persistent: bool = False):
        self._make, self.persistent = make, persistent
        self._loader: DataLoader | None = None
        self._batches = None  # torch's iterator of the pass begun last
        self._started = False  # a pass begun by start() that no iteration has taken yet
        self._passes = 0  # passes begun: an abandoned pass must not end the workers of a later one
        _open_loaders.add(self)

    def start(self) -> None:
        """Begin the next pass now (the workers read the stream's epoch as it is set now)."""
        with interrupts_deferred():
            if self._loader is None or not self.persistent:
                self._shutdown()
                self._loader = self._make()
            self._batches = iter(self._loader)  # persistent workers drop what the last pass left
        self._started, self._passes = True, self._passes + 1

    def __iter__(self) -> Iterator[dict]:
        if not self._started:
            self.start()
        self._started, batches, mine = False, self._batches, self._passes
        pin = self._loader.pin_memory
        finished = False
        try:
            while True:
                with interrupts_deferred():
                    batch = next(batches, self._END)
                if batch is self._END:
                    finished = True
                    return
                yield unpacked(batch, pin)
        finally:
            del batches
            # a later pass (start()) owns the workers now; else end them, unless they are to persist
            if mine == self._passes and not (finished and self.persistent):
                self.close()

    def close(self) -> None:
        """End the workers now; a later pass starts new ones."""
        self._started = False
        self._shutdown()
        self._loader = None

    def _shutdown(self) -> None:
        batches, self._batches = self._batches, None
        with interrupts_deferred():
            # the workers are joined here, not in a __del__ at some later moment: a worker's error
            # re-raised here keeps the iterator alive in a reference cycle (the exception's traceback
            # holds its frames), and workers that ignore SIGTERM (shielded stop signals) would then
            # hold the process at exit
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            del batches


# Loaders whose workers may still run: ended before multiprocessing's exit handler, which would
# wait forever for workers that ignore its SIGTERM (shielded stop signals). atexit runs handlers
# last registered first, and multiprocessing.util and torch register theirs when imported, above.
_open_loaders: weakref.WeakSet[Loader] = weakref.WeakSet()


@atexit.register
def _close_open_loaders() -> None:
    for loader in list(_open_loaders):
        loader.close()
