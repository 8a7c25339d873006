"""Samples read by their index (data/sample_index.py): only their bytes, from local disk or a store.

The samples asked of one shard are sorted by offset and those close together read as one range
(a seek and one read on disk, one ranged GET from a store, through the retrying ResumableReader).
With data.cache_dir, a remote shard is downloaded once per node and read from there
(store/cache.py): a set read many times over is then served from local disk.

`read_stats` counts what this process read this way, for the benchmarks and tests that check that
a rank reads only its own samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from vldist.store.access import StoreAccess
from vldist.store.cache import ShardCache
from vldist.store.location import is_url
from vldist.store.reader import ResumableReader

# Two samples with at most this many bytes between them are read in one range: a second request
# costs more than reading a few kilobytes that are dropped.
COALESCE_GAP = 64 << 10


@dataclass
class ReadStats:
    bytes: int = 0
    requests: int = 0

    def reset(self) -> None:
        self.bytes = self.requests = 0


read_stats = ReadStats()


def coalesced(spans: Sequence[tuple[int, int]], gap: int = COALESCE_GAP) -> list[tuple[int, int]]:
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
    access = access or StoreAccess()
    ranges = coalesced(spans)
    read = _local_reader(url, access)
    chunks = {}
    for start, end in ranges:
        chunks[start] = read(start, end)
        read_stats.bytes += end - start
        read_stats.requests += 1
    out = []
    for start, end in spans:
        first = _covering(ranges, start)
        out.append(chunks[first][start - first : end - first])
    return out


def _covering(ranges: list[tuple[int, int]], position: int) -> int:
    """The start of the range that holds `position` (ranges sorted and disjoint)."""
    low, high = 0, len(ranges) - 1
    while low < high:  # the last range starting at or before position
        middle = (low + high + 1) // 2
        if ranges[middle][0] <= position:
            low = middle
        else:
            high = middle - 1
    return ranges[low][0]


def _local_reader(url: str, access: StoreAccess) -> Callable[[int, int], bytes]:
    """A function reading [start, end) of the shard: from a file (a local shard, or a remote one's
    cached copy), or by ranged reads from the store."""
    if is_url(url) and access.cache is None:
        return lambda start, end: _ranged(url, access, start, end)
    path = url
    if is_url(url):
        path = ShardCache(access.cache).fetch(url, lambda u: ResumableReader(u, access), access.checksums.get(url))

    def read(start: int, end: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    return read


def _ranged(url: str, access: StoreAccess, start: int, end: int) -> bytes:
    with ResumableReader(url, access, start=start, end=end) as reader:
        parts = []
        while chunk := reader.read(end - start - sum(map(len, parts))):
            parts.append(chunk)
        return b"".join(parts)


def samples_by_shard(requests: Iterator[tuple[int, int]]) -> dict[int, list[int]]:
    """(shard, row) requests grouped by shard, rows in the order asked."""
    grouped: dict[int, list[int]] = {}
    for shard, row in requests:
        grouped.setdefault(shard, []).append(row)
    return grouped
