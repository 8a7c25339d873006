"""The sample index of a shard: where each sample's bytes lie in its tar, so that one sample can be
read alone (a seek on disk, a ranged read from a store) instead of the shard front to back.

A sample is its members, contiguous in the tar (the writer keeps them so, and WebDataset's key
grouping needs it anyway): it spans from its first member's header to the end of its last
member's data, padding included. The index of `train-000000.tar` is `train-000000.tar.idx.json`
beside it (shards/format/layout.py), written by the writer as it writes the shard or afterwards by
`python -m vldist.shards index DIR|URL`:

    {"format": "vldist-sample-index", "version": 1, "shard": "train-000000.tar", "bytes": 2150400,
     "keys": ["train-0000000", ...], "offsets": [0, 2560, ...], "sizes": [2560, ...]}

Those bytes parsed as a tar (tar_samples) give the raw sample the shard's stream would have given.
WebDataset's `wids` keeps a similar index (built by scanning each tar); no library here writes one
as a shard is written or reads samples by it through vldist's retrying store reader.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from vldist.errors import ShardsUnfitError

FORMAT = "vldist-sample-index"
VERSION = 1
_BLOCK = 512  # tar's block: a member's data is padded to a whole number of them


@dataclass(frozen=True)
class ShardIndex:
    shard: str  # the shard's file name
    bytes: int  # the shard's size: an index of another version of the file is refused
    keys: tuple[str, ...]
    offsets: tuple[int, ...]  # where each sample's first header begins
    sizes: tuple[int, ...]  # its bytes, to the end of its last member's padding

    def __len__(self) -> int:
        return len(self.keys)

    def span(self, row: int) -> tuple[int, int]:
        """The bytes [start, end) of sample `row` in the shard."""
        return self.offsets[row], self.offsets[row] + self.sizes[row]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "shard": self.shard,
                "bytes": self.bytes,
                "keys": list(self.keys),
                "offsets": list(self.offsets),
                "sizes": list(self.sizes),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ShardIndex:
        """Parsed and checked; a damaged index is refused by name with what to do."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} version {VERSION}")
            index = cls(
                str(data["shard"]),
                int(data["bytes"]),
                tuple(str(k) for k in data["keys"]),
                tuple(int(o) for o in data["offsets"]),
                tuple(int(s) for s in data["sizes"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ShardsUnfitError(
                f"the sample index {where} is damaged ({err}); rebuild it with `python -m vldist.shards index "
                "<the set>`"
            ) from None
        if not len(index.keys) == len(index.offsets) == len(index.sizes):
            raise ShardsUnfitError(
                f"the sample index {where} has {len(index.keys)} keys, {len(index.offsets)} offsets and "
                f"{len(index.sizes)} sizes; rebuild it with `python -m vldist.shards index <the set>`"
            )
        return index


class IndexBuilder:
    """Collects the samples of a shard as they are written or scanned, checking that each sample's
    members are contiguous."""

    def __init__(self, shard: str):
        self.shard = shard
        self.keys: list[str] = []
        self.offsets: list[int] = []
        self.ends: list[int] = []
        self._seen: set[str] = set()

    def add(self, key: str, start: int, end: int) -> None:
        """A member of sample `key` spanning [start, end): a new sample, or the current one grown."""
        if self.keys and self.keys[-1] == key:
            self.ends[-1] = end
            return
        if key in self._seen:
            raise ShardsUnfitError(
                f"{self.shard}: the members of sample {key!r} are not contiguous in the tar; WebDataset reads "
                "such a sample as two, and no index can describe it. Rewrite the shard with each sample's members "
                "together (vldist's writer does)"
            )
        self._seen.add(key)
        self.keys.append(key)
        self.offsets.append(start)
        self.ends.append(end)

    def finish(self, size: int) -> ShardIndex:
        sizes = tuple(e - o for o, e in zip(self.offsets, self.ends, strict=True))
        return ShardIndex(self.shard, size, tuple(self.keys), tuple(self.offsets), sizes)


def index_tar(stream, shard: str) -> ShardIndex:
    """The index of a tar read front to back from `stream` (headers parsed, data skipped)."""
    counted = _Counted(stream)
    with tarfile.open(fileobj=counted, mode="r|") as tar:
        index = index_tar_members(tar, shard, 0)
    return ShardIndex(index.shard, counted.position, index.keys, index.offsets, index.sizes)


def index_tar_members(tar: tarfile.TarFile, shard: str, size: int) -> ShardIndex:
    """The index of an opened tar of `size` bytes, from its members' headers."""
    builder = IndexBuilder(shard)
    for member in tar:
        if not member.isfile():
            continue
        key, _ = base_plus_ext(member.name)
        if key is not None:
            builder.add(key, member.offset, member.offset_data + _padded(member.size))
    return builder.finish(size)


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


class _Counted(io.RawIOBase):
    """A stream that counts the bytes read through it: the shard's size, without asking the store."""

    def __init__(self, stream):
        self.stream, self.position = stream, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


_REGULAR = (b"0", b"\0", b"7")  # tarfile's REGULAR_TYPES
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta


def one_sample(data: bytes, url: str) -> dict | None:
    """The raw sample in one sample's bytes, parsed from its 512-byte headers directly: what
    tar_samples gives, at a fraction of the cost of a tarfile opened per sample (most of an
    indexed pass on disk went there). Reads the POSIX ustar fields (name, prefix, size, type) and
    checks each header's checksum; None where a header is one it leaves to tarfile (PAX or GNU
    extended headers, a size in base-256); raises on a damaged header or members of two keys."""
    sample: dict = {}
    position = 0
    while position + _BLOCK <= len(data):
        block = data[position : position + _BLOCK]
        if block.count(0) == _BLOCK:  # the archive's end
            break
        kind, size_field = block[156:157], block[124:136]
        if kind not in _REGULAR and kind != b"5" or size_field[0] & 0x80:
            return None  # extended headers, links, base-256 sizes: tarfile's job
        checksum = int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
        if checksum != sum(block[:148]) + 256 + sum(block[156:]):
            raise tarfile.HeaderError(f"bad checksum in a header of {url}")
        size = int(size_field.split(b"\0", 1)[0].strip() or b"0", 8)
        start = position + _BLOCK
        position = start + _padded(size)
        name = block[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if block[257:263] == b"ustar\0" and block[345] != 0:  # a long name's leading directories
            name = block[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + name
        if kind not in _REGULAR or ("/" not in name and name.startswith("__") and name.endswith("__")):
            continue
        if _META.match(name):
            continue
        key, ext = base_plus_ext(name)
        if key is None:
            continue
        if sample.setdefault("__key__", key) != key:
            raise ValueError(f"the bytes of sample {sample['__key__']!r} in {url} also hold members of {key!r}")
        sample[ext.lower()] = data[start : start + size]
    if sample:
        sample["__url__"] = url
    return sample


def tar_samples(data: bytes, url: str, handler) -> Iterator[dict]:
    """The raw samples ({"__key__", "__url__", member: bytes}) in some whole samples' bytes of a
    shard, parsed as the shard's stream is (WebDataset's tar expander and key grouping)."""
    files = tar_file_expander(iter([{"url": url, "stream": io.BytesIO(data)}]), handler=handler)
    return group_by_keys(files, handler=handler)
