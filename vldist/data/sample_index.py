"""The sample index of a shard: where each sample's bytes lie in its tar, so that one sample can be
read alone (a seek on disk, a ranged read from a store) instead of the shard front to back.

A sample is its members, contiguous in the tar (the writer keeps them so, and WebDataset's key
grouping needs it anyway): it spans from its first member's header to the end of its last
member's data, padding included. The index of `train-000000.tar` is `train-000000.tar.idx.json`
beside it (shards/format/layout.py), written by the writer as it writes the shard or afterwards by
`python -m vldist.shards index DIR|URL`:

    {"format": "vldist-sample-index", "version": 1, "shard": "train-000000.tar", "bytes": 2150400,
     "keys": ["train-0000000", ...], "offsets": [0, 2560, ...], "sizes": [2560, ...]}

A shard that is cut short (an interrupted copy or upload) is found by scan_tar, which says where
it breaks; `index --partial` then indexes the whole samples before that byte, and the index says so
with `"cut": <that byte>` (a reader that does not know the key reads the index as any other).

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
    cut: int | None = None  # a shard cut short: its whole samples, indexed here, end at this byte

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
                **({"cut": self.cut} if self.cut is not None else {}),
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
                None if data.get("cut") is None else int(data["cut"]),
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

    def finish(self, size: int, cut: int | None = None) -> ShardIndex:
        sizes = tuple(e - o for o, e in zip(self.offsets, self.ends, strict=True))
        return ShardIndex(self.shard, size, tuple(self.keys), tuple(self.offsets), sizes, cut)

    def drop_last(self) -> int | None:
        """Forget the last sample (one the shard's cut may have left without all its members);
        returns where it began, None when there was none."""
        if not self.keys:
            return None
        self._seen.discard(self.keys.pop())
        self.ends.pop()
        return self.offsets.pop()


@dataclass(frozen=True)
class Cut:
    """Where a shard stops being a whole tar: `at`, the byte where its whole samples end (where
    the first sample that is not known to be whole begins); `how`, what the bytes there are."""

    at: int
    how: str  # "it ends at byte 31332, inside member 'train-0000035.json' that begins at byte 30720"
    what: str = "cut short"  # or "damaged" (a header that is not one), or "cut short or damaged"


def scan_tar(fileobj, shard: str) -> tuple[ShardIndex, Cut | None]:
    """The index of the whole samples of the tar in `fileobj` (seekable: a file, or a stream
    through ForwardReader), and where the tar breaks, None when it is whole: a member or header
    that runs past the end, a damaged header, or no end-of-archive block after the last member.
    Whatever breaks it, the last sample before the break is left out too: the members it may still
    have had are gone. The index never names a byte the shard does not hold."""
    builder, cut, last = IndexBuilder(shard), None, None
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:")
    except tarfile.ReadError as err:  # the first header: missing, cut or damaged
        size = fileobj.seek(0, io.SEEK_END)
        how = "it is empty" if size == 0 else f"its first header does not read ({err})"
        return builder.finish(size, 0), Cut(0, how)
    with tar:
        while True:
            try:
                member = tar.next()
            except tarfile.ReadError as err:
                # tarfile reads on past a member's data only here: the last member's data (or padding)
                # runs past the end, or an extended header's member is missing
                if str(err) == "unexpected end of data" and last is not None:
                    cut = ("member", last)
                else:
                    cut = ("header", f"the header at byte {tar.offset} does not read ({err})")
                break
            if member is None:
                fileobj.seek(tar.offset)
                block = fileobj.read(_BLOCK)
                if len(block) < _BLOCK or block.count(0) != _BLOCK:
                    cut = ("end", block)
                break
            last = member
            if member.isfile():
                key, _ = base_plus_ext(member.name)
                if key is not None:
                    builder.add(key, member.offset, member.offset_data + _padded(member.size))
        end = tar.offset
    size = fileobj.seek(0, io.SEEK_END)
    if cut is None:
        return builder.finish(size), None
    kind, found = cut
    what = "cut short"
    if kind == "member":
        how = f"it ends at byte {size}, inside member {found.name!r} that begins at byte {found.offset}"
    elif kind == "header":  # an extended header whose member is missing: cut there, or damaged
        how, what = found, "cut short or damaged"
    elif not found:
        how = f"it ends at byte {size} without tar's end-of-archive block"
    elif len(found) < _BLOCK:
        how = f"it ends at byte {size}, inside the header that begins at byte {end}"
    else:
        how, what = f"the header at byte {end} is not a tar header", "damaged"
    dropped = builder.drop_last()
    at = dropped if dropped is not None else 0
    return builder.finish(size, at), Cut(at, how, what)


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


class ForwardReader(io.RawIOBase):
    """A stream read front to back, seekable as scan_tar needs: a seek forward skips bytes (read
    and dropped), a seek back goes over the last bytes read, kept (tarfile reads the block at the
    end of the last member again); SEEK_END reads the rest. Nothing else of the stream is kept."""

    KEEP = 1 << 16

    def __init__(self, stream):
        self.stream, self.pos, self.end, self.kept = stream, 0, 0, b""  # kept: the bytes [end - len(kept), end)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self.pos
        elif whence == io.SEEK_END:
            self._fill(None)
            offset += self.end
        if offset < self.end - len(self.kept):
            raise io.UnsupportedOperation(f"cannot seek back to byte {offset} of a stream read on to byte {self.end}")
        self.pos = offset
        return offset

    def _fill(self, upto: int | None) -> None:
        """Read on to byte `upto` (None: the end), keeping the last bytes and those from pos on."""
        while upto is None or self.end < upto:
            data = self.stream.read(1 << 20 if upto is None else min(1 << 20, upto - self.end))
            if not data:
                return
            self.end += len(data)
            self.kept = (self.kept + data)[-max(self.KEEP, self.end - self.pos) :]

    def readinto(self, buffer) -> int:
        self._fill(self.pos + len(buffer))
        start = self.pos - (self.end - len(self.kept))
        data = self.kept[start : start + len(buffer)]
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


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
