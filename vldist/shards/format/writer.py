"""A generic writer of WebDataset shard sets in the layout of shards/README.md (file names: layout.py).

Tars are written with `tarfile` directly so that the same samples always give the same bytes
(fixed mtime, owner and mode; a sample's members contiguous and sorted by extension). A shard is
written under a `.tmp` name and renamed only once complete, and `manifest.json` is written last,
so a set without a manifest (or with `.tmp` files) is recognisably unfinished. Each shard's
sample index (data/sample_index.py) is recorded as the shard is written and put beside it before
the shard is renamed into place.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from vldist.data.sample_index import IndexBuilder
from vldist.data.vocab import tokenize
from vldist.file_integrity import sha256_file, write_json_atomic, write_text_atomic
from vldist.shards.format.layout import MANIFEST_NAME, index_name, shard_name

FORMAT_NAME = "vldist-shards"
FORMAT_VERSION = 1

# WebDataset splits `<key>.<ext>` at the first dot of the file name, so a key has no dot (and no
# slash, which would make a directory member); extensions are dot-separated words ("regions.npy").
_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")
_EXT = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_SPLIT = re.compile(r"^[A-Za-z0-9_]+$")


def encode_value(ext: str, value: Any) -> bytes:
    """The bytes stored for one member: dict/list -> JSON, ndarray -> .npy, str -> UTF-8."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value)).encode("utf-8")  # WebDataset's convention for `.cls` members
    raise TypeError(
        f"cannot store member {ext!r} of type {type(value).__name__}: pass bytes, str, int, "
        "a dict/list (stored as JSON) or a numpy array (stored as .npy)"
    )


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def check_split(split: str) -> None:
    if not _SPLIT.match(split):
        raise ValueError(f"split name {split!r} must be letters, digits or '_' (it names the shards)")


def sample_members(sample: dict) -> tuple[str, list[tuple[str, bytes]]]:
    """A sample dict (`__key__` plus member extension -> value) as its key and encoded members,
    sorted by extension; raises ValueError naming what is wrong."""
    key = sample.get("__key__")
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(
            f"sample key {key!r} must be a non-empty string of letters, digits, '_' or '-' "
            "(no dots or slashes: WebDataset splits member names at the first dot)"
        )
    members = []
    for ext in sorted(k for k in sample if not k.startswith("__")):
        if not _EXT.match(ext):
            raise ValueError(f"member extension {ext!r} of sample {key!r} is not a valid name")
        members.append((ext, encode_value(ext, sample[ext])))
    if not members:
        raise ValueError(f"sample {key!r} has no members to write")
    return key, members


def caption_words(members: list[tuple[str, bytes]]) -> Counter:
    """How many captions of each length in words (vldist's tokenizer: data/vocab.py) a sample's
    json member holds; a training job says what data.max_caption_len cuts off (data/fit_to_job.py)."""
    for ext, data in members:
        if ext == "json":
            try:
                captions = json.loads(data).get("captions")
            except (ValueError, AttributeError):
                return Counter()
            if isinstance(captions, list):
                return Counter(len(tokenize(c)) for c in captions if isinstance(c, str))
    return Counter()


def build_manifest(source: str, shards_by_split: dict[str, list[dict]], extra: dict | None = None) -> dict:
    """manifest.json's content: format, version, source, the `extra` keys, then splits with counts.
    A split whose every shard record has `caption_words` gets them summed (its captions by length
    in words, {"7": 120, ...}); the shard entries keep file, samples and sha256."""
    manifest: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "source": source}
    for name, value in (extra or {}).items():
        if name in ("format", "version", "splits"):
            raise ValueError(f"extra manifest key {name!r} would overwrite a required field")
        manifest[name] = value
    manifest["splits"] = {}
    for split, shards in shards_by_split.items():
        entry: dict[str, Any] = {
            "samples": sum(s["samples"] for s in shards),
            "shards": [{k: v for k, v in s.items() if k != "caption_words"} for s in shards],
        }
        if shards and all("caption_words" in s for s in shards):
            words = sum((Counter({int(n): c for n, c in s["caption_words"].items()}) for s in shards), Counter())
            entry["caption_words"] = {str(n): words[n] for n in sorted(words)}
        manifest["splits"][split] = entry
    return manifest


class ShardFile:
    """One tar being filled: written as `<name>.tmp`, renamed into place by finish()."""

    def __init__(self, out_dir: Path, split: str, index: int):
        self.final = out_dir / shard_name(split, index)
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.PAX_FORMAT)
        self.samples = 0
        self.index = IndexBuilder(self.final.name)
        self.caption_words: Counter = Counter()  # captions by length in words (build_manifest)

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        start = self.tar.offset
        for ext, data in members:
            self.tar.addfile(_tar_info(f"{key}.{ext}", len(data)), io.BytesIO(data))
        self.index.add(key, start, self.tar.offset)
        self.caption_words.update(caption_words(members))
        self.samples += 1

    def finish(self) -> dict:
        self.tar.close()
        index = self.index.finish(self.tmp.stat().st_size)
        write_text_atomic(self.final.with_name(index_name(self.final.name)), index.to_json())
        os.replace(self.tmp, self.final)
        return {
            "file": self.final.name,
            "samples": self.samples,
            "sha256": sha256_file(self.final),
            "caption_words": {str(n): self.caption_words[n] for n in sorted(self.caption_words)},
        }

    def abandon(self) -> None:
        self.tar.close()
        self.tmp.unlink(missing_ok=True)


class ShardSetWriter:
    """Writes samples into `<split>-NNNNNN.tar` shards of `shard_size` samples, then a manifest.

        with ShardSetWriter("shards/mine", shard_size=1000, source="coco") as writer:
            writer.write("train", {"__key__": "train-0000000", "jpg": jpeg_bytes, "json": meta})
            manifest = writer.close(extra={"features": {...}})

    A `with` block that ends normally closes the writer (if close() was not called); one that ends
    with an exception discards the open shards and writes no manifest.
    """

    def __init__(self, out_dir: str | Path, shard_size: int = 1000, source: str = "unknown"):
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.source = source
        self._open: dict[str, ShardFile] = {}
        self._finished: dict[str, list[dict]] = {}
        self._keys: set[str] = set()
        self._closed = False

    def write(self, split: str, sample: dict) -> None:
        if self._closed:
            raise RuntimeError("this ShardSetWriter is closed; open a new one to write more samples")
        check_split(split)
        key, members = sample_members(sample)
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}: keys must be unique across the whole set")
        self._keys.add(key)

        shard = self._open.get(split)
        if shard is None:
            index = len(self._finished.setdefault(split, []))
            shard = self._open[split] = ShardFile(self.out_dir, split, index)
        shard.add(key, members)
        if shard.samples >= self.shard_size:
            self._finished[split].append(shard.finish())
            del self._open[split]

    def close(self, extra: dict | None = None) -> dict:
        """Finish the open shards and write manifest.json; `extra` keys are merged into it."""
        if self._closed:
            raise RuntimeError("this ShardSetWriter is already closed")
        for split, shard in sorted(self._open.items()):
            self._finished[split].append(shard.finish())
        self._open.clear()
        self._closed = True
        manifest = build_manifest(self.source, self._finished, extra)
        write_json_atomic(self.out_dir / MANIFEST_NAME, manifest)
        return manifest

    def abort(self) -> None:
        """Discard the shards still open (their .tmp files); no manifest is written."""
        for shard in self._open.values():
            shard.abandon()
        self._open.clear()
        self._closed = True

    def __enter__(self) -> ShardSetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()
