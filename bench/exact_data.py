"""What a sample index (data/sample_index.py) changes in reading training data: the bytes each
rank reads, samples/s from local disk and from an S3 store, the epoch order's windows, and the
time a resumed pass takes to its first batch.

    python bench/exact_data.py --json docs/results/exact_data.json     # every case, ~6 min on 2 cores
    python bench/exact_data.py --cases bytes order --repeats 1         # some cases, once
    python bench/exact_data.py --from docs/results/exact_data.json     # the tables, no runs

The bench writes its own set (ShardSetWriter, seed 0): --samples samples of a `json` (one short
caption) and a `regions.npy` of shape (4, 32) float16, --shard-size samples a shard, each shard's
index beside it; a copy without the index files (the same tars, hard-linked) gives the streams
an unindexed set gets. The sample function returns the key and the regions' byte length only, so
that I/O and order are measured, not decoding. Every stream is iterated in this process (workers
0), rank r of W simulated by a stream built with rank=r, world_size=W, batch --batch per rank,
shuffle buffer --shuffle-buffer. Streams:

- indexed exact / indexed resampled: IndexedStream (data/indexed_stream.py);
- unindexed exact: ExactEpochStream (every rank reads every shard, keeps its rows);
- unindexed resampled: TrainStream (shards drawn with replacement, a shuffle buffer);
- full permutation (case `order`): IndexedStream with one permutation of the whole epoch in place
  of ExactOrder's windows, read by the same read_spans.

Bytes read: an indexed stream's are read_stats.bytes (the coalesced ranges read); an unindexed
stream's are the bytes read from the files open_shard opened (counted by wrapping it); from the
store, the bytes that came through ResumableReader (ranged reads, whole shards, cache downloads
alike) and the HTTP requests the proxy saw. Cases:

- bytes: one exact epoch of every rank at --worlds, indexed against unindexed, local disk;
- local: --batches batches of rank 0, the four streams, world 1 and 2, local disk;
- s3: the same from SeaweedFS on 127.0.0.1 (tests/seaweed.py) through tests/fault_proxy.py, which
  cuts the first --cuts GETs of each pass after 1,000 response bytes, a set of --s3-samples,
  --s3-batches batches, without data.cache_dir and with it (cold: a new cache each pass). s3fs
  tries a GET five times itself: the default two cuts are retried there; --cuts 6 makes vldist's
  ResumableReader resume a read too (and adds s3fs's ~2 s of waits to the pass);
- order: ExactOrder's windows against a full permutation, local disk and S3 without a cache;
- resume: the trainer's TrainingStreams (workers 0) from ShardSet.open to the first batch of a
  pass resumed at --at of the epoch: indexed (the pass begins there) against unindexed (the epoch
  read from its start and the batches before the step dropped), exact and resampled.

Each timing is repeated --repeats times, the cases of a table alternating within each round;
tables give the median and the range (min-max).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the store's launcher and the fault proxy

KEEP = ("json", "regions.npy")
CUT_AT = 1000  # response bytes before a planned cut: past the headers, inside the smallest range
CASES = ("bytes", "local", "s3", "order", "resume")
STREAMS = ("indexed exact", "unindexed exact", "indexed resampled", "unindexed resampled")


# ---------------------------------------------------------------- the set


def key_and_size(raw: dict, rng) -> dict:
    """The recipe's work kept to nothing: the key and the regions' bytes, undecoded."""
    return {"key": raw["__key__"], "regions_bytes": len(raw["regions.npy"])}


def keys(samples: list[dict]) -> dict:
    return {"keys": [s["key"] for s in samples]}


def build_set(directory: Path, samples: int, shard_size: int, seed: int = 0) -> Path:
    """An indexed shard set of small features (ShardSetWriter writes each shard's index)."""
    import numpy as np

    from vldist.shards.format.writer import ShardSetWriter

    regions = np.random.default_rng(seed).standard_normal((samples, 4, 32)).astype(np.float16)
    with ShardSetWriter(directory, shard_size=shard_size, source="bench/exact_data.py") as writer:
        for i in range(samples):
            caption = {"captions": [f"a photo of object {i % 97} on a table"]}
            writer.write("train", {"__key__": f"s{i:07d}", "json": caption, "regions.npy": regions[i]})
        writer.close()
    return directory


def unindexed_copy(indexed: Path, directory: Path) -> Path:
    """The same tars and manifest without the index files: what an older set holds."""
    directory.mkdir(parents=True)
    for path in indexed.iterdir():
        if not path.name.endswith(".idx.json"):
            os.link(path, directory / path.name)
    return directory


def set_facts(indexed: Path) -> dict:
    from vldist.data.shardset import ShardSet
    from vldist.shards.format.layout import index_name

    shard_set = ShardSet.open(indexed)
    indexes = shard_set.sample_indexes("train")
    samples = sum(len(i) for i in indexes)
    index_files = [indexed / index_name(url.rsplit("/", 1)[-1]) for url in shard_set.urls("train")]
    return {
        "index_bytes": sum(f.stat().st_size for f in index_files),
        "samples": samples,
        "shards": len(indexes),
        "bytes": sum(i.bytes for i in indexes),
        "sample_bytes": sum(sum(i.sizes) for i in indexes) / samples,  # a sample's own span, headers included
    }


# ---------------------------------------------------------------- counting what is read


@dataclasses.dataclass
class Reads:
    """What a pass read: from local files (by index or whole), from the store, and what it cost."""

    index_bytes: int = 0
    index_requests: int = 0
    file_bytes: int = 0  # through the files open_shard opened (unindexed streams)
    store_bytes: int = 0  # through ResumableReader: every byte that came from the store
    reopened: int = 0  # ResumableReader's reads resumed after an error


class _CountedFile:
    """A shard file that adds what is read from it to the counter."""

    def __init__(self, stream, reads: Reads):
        self._stream, self._reads = stream, reads

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._reads.file_bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def counted_reads():
    """Yields a Reads filled while the block runs (this process only: workers 0)."""
    from vldist.data import shard_stream
    from vldist.data.sample_reader import read_stats
    from vldist.store.reader import ResumableReader

    reads = Reads()
    open_shard, readinto = shard_stream.open_shard, ResumableReader.readinto

    def counted_open(where, access=None):
        return _CountedFile(open_shard(where, access), reads)

    def counted_readinto(self, buffer):
        before = self.reopened
        got = readinto(self, buffer)
        reads.store_bytes += got
        reads.reopened += self.reopened - before
        return got

    read_stats.reset()
    shard_stream.open_shard, ResumableReader.readinto = counted_open, counted_readinto
    try:
        yield reads
    finally:
        shard_stream.open_shard, ResumableReader.readinto = open_shard, readinto
        reads.index_bytes, reads.index_requests = read_stats.bytes, read_stats.requests


# ---------------------------------------------------------------- the streams


def full_permutation_stream(spec, sources):
    """IndexedStream with one permutation of the whole epoch for an order: what ExactOrder's
    windows are measured against (every batch spread over every shard)."""
    import numpy as np

    from vldist.data.epoch_order import ExactOrder
    from vldist.data.indexed_stream import IndexedStream

    class FullPermutation(ExactOrder):
        def __init__(self, counts, seed: int, epoch: int):
            super().__init__(counts, seed, epoch, window=1)  # shards permuted, nothing within
            self.permutation = np.random.default_rng([seed, epoch, 7]).permutation(self.size)

        def samples(self, start: int, stop: int) -> list[tuple[int, int]]:
            positions = self.permutation[start:stop]
            slot = np.searchsorted(self.ends, positions, side="right")
            return list(zip(self.order[slot].tolist(), (positions - self.starts[slot]).tolist(), strict=True))

        def sample(self, position: int) -> tuple[int, int]:
            return self.samples(position, position + 1)[0]

    class FullPermutationStream(IndexedStream):
        def _orders(self, epoch: int):
            return [FullPermutation(self.sources[0].counts, self.spec.seed, epoch)]

    return FullPermutationStream(spec, sources, 0, True)


@dataclasses.dataclass
class Source:
    """One copy of the set: its indexed and unindexed ShardSets (local, or in the store)."""

    indexed: object
    unindexed: object
    proxy: object = None  # the fault proxy in front of the store, if remote

    def __post_init__(self):
        self.indexed.sample_indexes("train")  # read once, before any pass is timed

    def shard_set(self, stream: str):
        return self.unindexed if stream.startswith("unindexed") else self.indexed


def make_stream(stream: str, source: Source, rank: int, world: int, args, batches: int | None, cache: str | None):
    """The stream `stream` (STREAMS, or "full permutation") of rank `rank` of `world`."""
    from vldist.data.indexed_stream import IndexedSource, IndexedStream
    from vldist.data.pipeline import ExactEpochStream, StreamSpec, TrainStream
    from vldist.store.cache import CacheConfig

    shard_set = source.shard_set(stream)
    access = shard_set.access
    if cache is not None:
        access = dataclasses.replace(access, cache=CacheConfig(cache, 100 << 30))
    spec = StreamSpec(
        urls=shard_set.urls("train"),
        keep=KEEP,
        sample_fn=key_and_size,
        collate_fn=keys,
        batch_size=args.batch,
        seed=args.seed,
        rank=rank,
        world_size=world,
        access=access,
    )
    samples = shard_set.num_samples("train")
    indexed = [IndexedSource("train", spec.urls, shard_set.sample_indexes("train"), access)]
    if stream == "indexed exact":
        return IndexedStream(spec, indexed, args.shuffle_buffer, True)
    if stream == "indexed resampled":
        return IndexedStream(spec, indexed, args.shuffle_buffer, False, batches=batches)
    if stream == "unindexed exact":
        return ExactEpochStream(spec, samples, args.shuffle_buffer)
    if stream == "unindexed resampled":
        return TrainStream(spec, batches, args.shuffle_buffer)
    if stream == "full permutation":
        return full_permutation_stream(spec, indexed)
    raise ValueError(stream)


def one_pass(stream, batches: int | None, proxy=None) -> dict:
    """Iterate `stream` (at most `batches` batches): samples, seconds, what was read."""
    requests_before = Counter(proxy.faults.methods) if proxy is not None else Counter()
    with counted_reads() as reads:
        start = time.perf_counter()
        taken = samples = 0
        with contextlib.closing(iter(stream)) as it:
            for batch in it:
                samples += len(batch["keys"])
                taken += 1
                if batches is not None and taken >= batches:
                    break
        seconds = time.perf_counter() - start
    out = {"batches": taken, "samples": samples, "seconds": seconds, **dataclasses.asdict(reads)}
    if proxy is not None:
        out["http"] = dict(Counter(proxy.faults.methods) - requests_before)
        out["cuts"] = proxy.faults.cuts_made
    return out


def rounds(cases: list[dict], run, repeats: int) -> list[dict]:
    """Each case's passes: one of every case per round, `repeats` rounds (a load that comes and
    goes on a shared machine then falls on every case alike)."""
    for case in cases:
        case["passes"] = []
    for r in range(repeats):
        for case in cases:
            case["passes"].append(run(case))
            p = case["passes"][-1]
            print(f"  round {r + 1}: {label(case)}: {p['seconds']:.2f} s, {p['samples']} samples", flush=True)
    return cases


def label(case: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in case.items() if k != "passes")


# ---------------------------------------------------------------- the cases


def bytes_per_rank(local: Source, args) -> list[dict]:
    """One exact epoch of every rank at each world size, indexed and unindexed."""
    cases = [{"world": w, "stream": s} for w in args.worlds for s in ("indexed exact", "unindexed exact")]

    def every_rank(case):
        ranks = []
        for rank in range(case["world"]):
            stream = make_stream(case["stream"], local, rank, case["world"], args, None, None)
            ranks.append(one_pass(stream, None))
        return {
            "samples": sum(p["samples"] for p in ranks),
            "seconds": sum(p["seconds"] for p in ranks),
            "ranks": ranks,
        }

    return rounds(cases, every_rank, args.repeats)


def samples_per_second(source: Source, args, streams, worlds, batches: int, caches=(None,)) -> list[dict]:
    """`batches` batches of rank 0 of each world, each stream (and cache choice)."""
    cases = [
        {"world": w, "stream": s, **({"cache": c} if c is not None else {})}
        for w in worlds
        for s in streams
        for c in caches
        if not (c and s == "full permutation")
    ]

    def run(case):
        cache = None
        if case.get("cache"):  # cold: a cache of this pass's own
            cache = tempfile.mkdtemp(prefix="cache-", dir=args.scratch)
        if source.proxy is not None:
            source.proxy.faults.plan(args.cuts)
        stream = make_stream(case["stream"], source, 0, case["world"], args, batches, cache)
        try:
            p = one_pass(stream, batches, source.proxy)
            if p["samples"] != batches * args.batch:
                raise RuntimeError(f"{label(case)}: {p['samples']} samples arrived of {batches * args.batch}")
            return p
        finally:
            if cache:
                shutil.rmtree(cache)

    return rounds(cases, run, args.repeats)


class _Recipe:
    """The least a recipe gives TrainingStreams: its stream, members and functions."""

    sample_keys, optional_keys = KEEP, ()

    @classmethod
    def train_streams(cls, config):
        return {"train": "train"}

    def stream_functions(self, name):
        return key_and_size, keys


def first_batch_seconds(where: str, access, args, resampled: bool, at: float) -> dict:
    """Seconds from opening the set to the first batch of a pass resumed at `at` of the epoch,
    as the trainer does it (TrainingStreams.batches(epoch, step), workers 0)."""
    from vldist.data.job_shards import JobShards
    from vldist.data.shardset import ShardSet
    from vldist.data.streams import TrainingStreams
    from vldist.recipes.jobs import load_config

    config = load_config(
        "vsrn",
        [
            f"data.shards={where}",
            f"data.batch_size={args.batch}",
            f"data.shuffle_buffer={args.shuffle_buffer}",
            "data.workers=0",
            f"data.resampled={str(resampled).lower()}",
            "train.epochs=1",
            f"seed={args.seed}",
        ],
    )
    with counted_reads() as reads:
        start = time.perf_counter()
        shards = JobShards(ShardSet.open(where, access))
        streams = TrainingStreams(config, _Recipe(), shards, rank=0, world_size=1)
        step = round(at * streams.steps_per_epoch)
        with contextlib.closing(streams.batches(0, step)) as batches:
            first = next(batches)
        seconds = time.perf_counter() - start
        streams.close()
    return {"step": step, "steps": streams.steps_per_epoch, "samples": len(first["keys"]), "seconds": seconds} | {
        "bytes": reads.index_bytes + reads.file_bytes if access is None else reads.store_bytes
    }


def resume(where: dict[str, str], access, args, source: str, proxy=None) -> list[dict]:
    """First batch of a resumed pass, indexed against unindexed, exact and resampled (no cuts)."""
    cases = [
        {"source": source, "mode": m, "stream": s, "at": at}
        for m in ("exact", "resampled")
        for at in args.at
        for s in ("indexed", "unindexed")
    ]

    def run(case):
        if proxy is not None:
            proxy.faults.plan(0)
        return first_batch_seconds(where[case["stream"]], access, args, case["mode"] == "resampled", case["at"])

    return rounds(cases, run, args.repeats)


# ---------------------------------------------------------------- the store


def _fault_plan_class():
    from fault_proxy import ProxyFaults

    class CutFirstGets(ProxyFaults):
        """The proxy's faults: the first `plan(n)` GETs of a pass cut after CUT_AT response bytes;
        every request counted by method."""

        def __init__(self):
            super().__init__()
            self.methods: Counter = Counter()
            self.cuts_left = self.cuts_made = 0

        def plan(self, cuts: int) -> None:
            with self.lock:
                self.cuts_left, self.cuts_made = cuts, 0

        def take(self, method: str, name: str):
            with self.lock:
                self.methods[method] += 1
                if method == "GET" and name.endswith(".tar") and self.cuts_left:
                    self.cuts_left -= 1
                    self.cuts_made += 1
                    return "cut", CUT_AT
            return None

    return CutFirstGets


@contextlib.contextmanager
def store_copy(indexed: Path, unindexed: Path, scratch: Path):
    """Both sets uploaded (publish_set) to SeaweedFS on 127.0.0.1, read through the fault proxy:
    yields (Source, the access, the two URLs); the store's process is stopped by its id after."""
    from fault_proxy import FaultProxy
    from seaweed import start_s3_store

    from vldist.data.shardset import ShardSet
    from vldist.store.access import StoreAccess
    from vldist.store.publish import publish_set

    (scratch / "store").mkdir()
    store = start_s3_store(scratch / "store")
    try:
        credentials = {"key": store.access_key, "secret": store.secret_key}
        direct = StoreAccess(storage_options={"endpoint_url": store.endpoint, **credentials})
        store.filesystem().mkdir("bench")
        urls = {"indexed": "s3://bench/indexed", "unindexed": "s3://bench/unindexed"}
        for name, local in (("indexed", indexed), ("unindexed", unindexed)):
            publish_set(local, urls[name], direct)
        with FaultProxy(store.endpoint) as proxy:
            proxy.faults = _fault_plan_class()()
            access = StoreAccess(storage_options={"endpoint_url": proxy.url, **credentials})
            source = Source(ShardSet.open(urls["indexed"], access), ShardSet.open(urls["unindexed"], access), proxy)
            yield source, access, urls
    finally:
        store.stop()


# ---------------------------------------------------------------- the tables


def _median_range(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def _rate(case: dict) -> str:
    return _median_range([p["samples"] / p["seconds"] for p in case["passes"]])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _bytes_read(p: dict) -> int:
    return p["index_bytes"] + p["file_bytes"]


def bytes_table(rows: list[dict], set_: dict) -> str:
    lines = [
        f"One exact epoch ({set_['samples']:,} samples, {set_['shards']} shards, {_mb(set_['bytes'])} MB; "
        f"a sample {set_['sample_bytes']:,.0f} bytes with its tar headers; the index files {_mb(set_['index_bytes'])} "
        "MB) read by every rank of W in turn, local disk (the set just written: in the page cache):",
        "",
        "| W | stream | samples per rank | MB read per rank | read / the rank's samples' bytes | "
        "samples/s per rank, median (range) |",
        "|---|---|---|---|---|---|",
    ]
    for case in rows:
        ranks = case["passes"][0]["ranks"]
        read = [_bytes_read(p) for p in ranks]
        own = [p["samples"] * set_["sample_bytes"] for p in ranks]
        ratio = [r / o for r, o in zip(read, own, strict=True)]
        rates = [p["samples"] / p["seconds"] for run in case["passes"] for p in run["ranks"]]
        lines.append(
            f"| {case['world']} | {case['stream']} | {_spread([p['samples'] for p in ranks])} | "
            f"{_spread([r / 1e6 for r in read], 1)} | x{_spread(ratio, 1)} | {_median_range(rates)} |"
        )
    return "\n".join(lines)


def _spread(values: list[float], digits: int = 0) -> str:
    """One value, or min-max when the ranks differ."""
    low, high = f"{min(values):,.{digits}f}", f"{max(values):,.{digits}f}"
    return low if low == high else f"{low}-{high}"


def speed_table(rows: list[dict], title: str, remote: bool) -> str:
    head = "| W | stream | samples/s, median (range) | MB read | requests per batch |"
    if remote:
        head = head.replace("| stream |", "| stream | cache |")
        head += " HTTP requests (GET + other) | connections cut, reads vldist's reader resumed |"
    lines = [title, "", head, "|---" * head.count(" | ") + "|---|"]
    for case in rows:
        p = case["passes"][0]  # what is read is the same every round
        read = p["store_bytes"] if remote else _bytes_read(p)
        requests = p["index_requests"] / p["batches"] if p["index_requests"] else None
        cells = [
            str(case["world"]),
            case["stream"],
            *(["cold" if case.get("cache") else "none"] if remote else []),
            _rate(case),
            _mb(read),
            f"{requests:.1f}" if requests is not None else "whole shards",
        ]
        if remote:
            http = p["http"]
            cells.append(f"{sum(http.values())} ({http.get('GET', 0)} + {sum(http.values()) - http.get('GET', 0)})")
            cells.append(f"{p['cuts']}, {p['reopened']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resume_table(rows: list[dict]) -> str:
    lines = [
        "| source | mode | resumed at | indexed: first batch, s | unindexed: first batch, s | "
        "indexed MB read | unindexed MB read |",
        "|---|---|---|---|---|---|---|",
    ]
    paired: dict[tuple, dict] = {}
    for case in rows:
        paired.setdefault((case["source"], case["mode"], case["at"]), {})[case["stream"]] = case
    for (source, mode, at), by in paired.items():
        p = by["indexed"]["passes"][0]
        seconds = {s: _median_range([q["seconds"] for q in c["passes"]], 2) for s, c in by.items()}
        lines.append(
            f"| {source} | {mode} | {at:.0%} (step {p['step']} of {p['steps']}) | {seconds['indexed']} | "
            f"{seconds['unindexed']} | {_mb(p['bytes'])} | {_mb(by['unindexed']['passes'][0]['bytes'])} |"
        )
    return "\n".join(lines)


def tables(results: dict) -> str:
    blocks = [
        f"{results['machine']}, torch {results['torch']}, Python {results['python']}; workers 0, batch "
        f"{results['batch']} per rank, shuffle buffer {results['shuffle_buffer']}; each timing {results['repeats']} "
        "times, median (range)",
        f"`{results['command']}`",
    ]
    if results.get("bytes"):
        blocks.append(bytes_table(results["bytes"], results["set"]))
    if results.get("local"):
        blocks.append(speed_table(results["local"], f"{results['batches']} batches of rank 0, local disk:", False))
    if results.get("s3"):
        s3 = results["s3_set"]
        blocks.append(
            speed_table(
                results["s3"],
                f"{results['s3_batches']} batches of rank 0 from S3 (SeaweedFS on 127.0.0.1 through the fault "
                f"proxy; a set of {s3['samples']:,} samples, {s3['shards']} shards; the first {results['cuts']} GETs "
                "of each pass cut):",
                True,
            )
        )
    if results.get("order"):
        blocks.append(
            speed_table(
                [c for c in results["order"] if c["source"] == "local disk"],
                f"The exact order: ExactOrder's windows of {results['shuffle_buffer']} against one permutation of "
                f"the epoch, {results['batches']} batches of rank 0, local disk:",
                False,
            )
        )
        remote = [c for c in results["order"] if c["source"] == "S3"]
        if remote:
            blocks.append(
                speed_table(
                    remote, f"The same, {results['s3_batches']} batches from S3 (ranged reads, no cache):", True
                )
            )
    if results.get("resume"):
        blocks.append(
            "A pass resumed mid-epoch (TrainingStreams.batches(epoch, step), world 1, the sets above): seconds from "
            "ShardSet.open to the first batch, and the shard bytes read to get it (the index files, read at the "
            "start, not counted):\n\n" + resume_table(results["resume"])
        )
    return "\n\n".join(blocks)


# ---------------------------------------------------------------- the run


def machine() -> str:
    names = [
        line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, no GPU"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--samples", type=int, default=60_000, help="the local set's samples")
    parser.add_argument("--s3-samples", type=int, default=10_000, help="the store's set's samples")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=128, help="per rank")
    parser.add_argument("--shuffle-buffer", type=int, default=2000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="case bytes")
    parser.add_argument("--batches", type=int, default=200, help="cases local and order, local disk")
    parser.add_argument("--s3-batches", type=int, default=20, help="cases s3 and order, from the store")
    parser.add_argument("--cuts", type=int, default=2, help="GETs cut at the start of each pass from the store")
    parser.add_argument("--at", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="case resume: where")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the tables of earlier results; no runs")
    return parser.parse_args()


def run(args) -> dict:
    import logging

    import numpy
    import torch

    from vldist.data.shardset import ShardSet

    results = {
        "machine": machine(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", "bench/exact_data.py", *sys.argv[1:]]),
        "batch": args.batch,
        "shuffle_buffer": args.shuffle_buffer,
        "batches": args.batches,
        "s3_batches": args.s3_batches,
        "cuts": args.cuts,
        "repeats": args.repeats,
    }
    logging.getLogger("vldist.data").setLevel(logging.ERROR)  # the unindexed set's advice, once a pass
    args.scratch = Path(tempfile.mkdtemp(prefix="vldist-exact-data-"))
    try:
        start = time.perf_counter()
        indexed = build_set(args.scratch / "indexed", args.samples, args.shard_size, args.seed)
        print(f"built {args.samples:,} samples in {time.perf_counter() - start:.1f} s", flush=True)
        unindexed = unindexed_copy(indexed, args.scratch / "unindexed")
        results["set"] = set_facts(indexed)
        local = Source(ShardSet.open(indexed), ShardSet.open(unindexed))
        if "bytes" in args.cases:
            print("bytes per rank, one exact epoch", flush=True)
            results["bytes"] = bytes_per_rank(local, args)
        if "local" in args.cases:
            print("samples/s, local disk", flush=True)
            results["local"] = samples_per_second(local, args, STREAMS, [1, 2], args.batches)
        if "order" in args.cases:
            print("the order, local disk", flush=True)
            order = samples_per_second(local, args, ("indexed exact", "full permutation"), [1], args.batches)
            results["order"] = [{"source": "local disk", **c} for c in order]
        if "resume" in args.cases:
            print("resume, local disk", flush=True)
            where = {"indexed": str(indexed), "unindexed": str(unindexed)}
            results["resume"] = resume(where, None, args, "local disk")
        if "s3" in args.cases:
            remote_sets(args, results)
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)
    return results


def remote_sets(args, results: dict) -> None:
    """The cases from the store, on a smaller set of their own."""
    indexed = build_set(args.scratch / "s3-indexed", args.s3_samples, args.shard_size, args.seed)
    unindexed = unindexed_copy(indexed, args.scratch / "s3-unindexed")
    results["s3_set"] = set_facts(indexed)
    with store_copy(indexed, unindexed, args.scratch) as (source, access, urls):
        print("samples/s, S3", flush=True)
        results["s3"] = samples_per_second(source, args, STREAMS, [1, 2], args.s3_batches, caches=(False, True))
        if "order" in args.cases:
            print("the order, S3", flush=True)
            order = samples_per_second(source, args, ("indexed exact", "full permutation"), [1], args.s3_batches)
            results["order"] += [{"source": "S3", **c} for c in order]
        if "resume" in args.cases:
            print("resume, S3", flush=True)
            results["resume"] += resume(urls, access, args, "S3", source.proxy)


def main() -> None:
    args = parse_args()
    if args.source:
        print(tables(json.loads(args.source.read_text())))
        return
    results = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(tables(results))


if __name__ == "__main__":
    main()
