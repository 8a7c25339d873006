"""Samples read by their index (data/sample_index.py): only their bytes, from local disk or a store.

The samples asked of one shard are sorted by offset and each run of adjacent ones read as one
range: a seek and one read on disk, one ranged GET from a store (through the retrying
ResumableReader). Samples with others' samples between them are read apart, so that a rank reads
its own samples' bytes and no others: the per-node cache (data.cache_dir) is the choice where many
small requests would cost more than whole shards.
With data.cache_dir, a remote shard is downloaded once per node and read from there
(store/cache.py): a set read many times over is then served from local disk.

`read_stats` counts what this process read this way, for the benchmarks and tests that check that
a rank reads only its own samples.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from vldist.store.access import StoreAccess
from vldist.store.cache import ShardCache
from vldist.store.location import is_url
from vldist.store.reader import ResumableReader


@dataclass
class ReadStats:
    bytes: int = 0
    requests: int = 0

    def reset(self) -> None:
        self.bytes = self.requests = 0


read_stats = ReadStats()


def coalesced(spans: Sequence[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """The ranges that cover `spans`, those at most `gap` bytes apart merged."""
    ranges: list[list[int]] = []
    for start, end in sorted(spans):
        if ranges and start - ranges[-1][1] <= gap:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    return [(s, e) for s, e in ranges]


def read_spans(url: str, spans: Sequence[tuple[int, int]], access: StoreAccess | None = None) -> list[bytes]:
    """The bytes of each span [start, end) of the shard at `url`, in the order asked."""
    return read_shards([(url, spans, access or StoreAccess())])[0]


def read_shards(requests: Sequence[tuple[str, Sequence[tuple[int, int]], StoreAccess]]) -> list[list[bytes]]:
    """For each (url, spans, access): the bytes of each span, in the order asked. The ranged reads
    from a store run READ_THREADS at a time (one after the other, each waits a round trip)."""
    plans = []
    for url, spans, access in requests:
        local = _local_copy(url, access)
        plans.append((url, spans, access, local, coalesced(spans)))
    fetched: list[dict[int, bytes | Future]] = []
    for url, _, access, local, ranges in plans:
        chunks: dict[int, bytes | Future] = {}
        if local is not None:
            with open(local, "rb") as f:
                for start, end in ranges:
                    f.seek(start)
                    chunks[start] = f.read(end - start)
        else:
            for start, end in ranges:
                chunks[start] = _pool().submit(_ranged, url, access, start, end)
        read_stats.bytes += sum(end - start for start, end in ranges)
        read_stats.requests += len(ranges)
        fetched.append(chunks)
    out = []
    for (_, spans, _, _, ranges), chunks in zip(plans, fetched, strict=True):
        starts = [start for start, _ in ranges]
        data = {s: c.result() if isinstance(c, Future) else c for s, c in chunks.items()}
        pieces = []
        for start, end in spans:
            first = starts[bisect.bisect_right(starts, start) - 1]  # the range that holds this span
            pieces.append(data[first][start - first : end - first])
        out.append(pieces)
    return out


READ_THREADS = 16
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's reading threads (a forked loader worker makes its own: threads do not fork)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools.clear()
        _pools[pid] = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="vldist-ranged-read")
    return _pools[pid]


def _local_copy(url: str, access: StoreAccess) -> str | None:
    """Where the shard can be read from local disk: its path, or a remote one's copy in this node's
    cache (downloaded first if need be); None when it is read by ranged reads from the store."""
    if not is_url(url):
        return url
    if access.cache is None:
        return None
    return ShardCache(access.cache).fetch(url, lambda u: ResumableReader(u, access), access.checksums.get(url))


def _ranged(url: str, access: StoreAccess, start: int, end: int) -> bytes:
    with ResumableReader(url, access, start=start, end=end) as reader:
        parts, got = [], 0
        while got < end - start and (chunk := reader.read(end - start - got)):
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)
