"""A shard set, in a local directory or at a URL (vldist/store): its manifest, the shard files of
each split, and its vocabulary."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import socket
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vldist.data.sample_index import ShardIndex
from vldist.data.vocab import Vocab
from vldist.errors import ShardsNotFoundError, ShardsUnfitError, StoreSupportMissing
from vldist.shards.format.layout import MANIFEST_NAME, VOCAB_NAME, index_name
from vldist.store.access import StoreAccess
from vldist.store.location import filesystem, is_url, join, list_names, redact, unreachable
from vldist.store.publish import INCOMPLETE
from vldist.store.reader import open_shard


def _how_to_build(directory: str | Path) -> str:
    if is_url(directory):
        return "Check the URL and that the set is there (its manifest.json and <split>-*.tar)."
    return (
        f"Build the embedded dataset with `python -m vldist.shards synth --out {directory}`, "
        "or set data.shards=<dir> to a shard set you converted (see shards/README.md). On several nodes, "
        "every node reads the set: put it on a disk they share, on each node, or in object storage (a URL)."
    )


def stale_index(where: str, indexed: int, size: int, directory: str) -> str:
    """The refusal of an index that describes another size of its shard; the command it names
    indexes the shard again, or, if the shard is cut short, says where and how to go on."""
    if size < indexed:  # shorter: most likely an interrupted copy
        return (
            f"the sample index {where} describes a shard of {indexed} bytes, and the shard has {size}: it was cut "
            f"short (an interrupted copy?) or rewritten after it was indexed. `python -m vldist.shards verify "
            f"{directory}` lists every problem; `python -m vldist.shards index {directory}` indexes the shard again, "
            "or, if it is cut short, says where and how to index its whole samples (--partial)"
        )
    return (
        f"the sample index {where} describes a shard of {indexed} bytes, and the shard has {size}: the shard was "
        f"rewritten after it was indexed. Rebuild the index with `python -m vldist.shards index {directory}`"
    )


@dataclass
class ShardSet:
    directory: Path | str  # a local directory, or a URL (str) read through fsspec
    manifest: dict
    access: StoreAccess = field(default_factory=StoreAccess, repr=False)  # data.storage_options, data.retries
    _counted: dict[str, int] = field(default_factory=dict, repr=False)  # splits counted without a manifest
    _names: dict[str, int | None] | None = field(
        default=None, repr=False
    )  # a remote set's files and sizes, listed once
    _indexes: dict[str, list[ShardIndex] | None] = field(default_factory=dict, repr=False)  # per split, read once

    @classmethod
    def open(cls, directory: str | Path, access: StoreAccess | None = None) -> ShardSet:
        access = access or StoreAccess()
        names = None
        if is_url(directory):  # one listing answers whether the set is there, whole, and what it holds
            directory = str(directory).rstrip("/")
            try:
                names = list_names(directory, access.storage_options)
            except StoreSupportMissing:
                raise
            except Exception as err:  # noqa: BLE001 - any failure to answer: refused or down, said as one
                raise unreachable(directory, err) from None
            if names is not None and INCOMPLETE in names:
                raise ShardsNotFoundError(
                    f"the shard set at {redact(directory)} is being written, or its upload was "
                    "interrupted: wait for it, or rerun the command that writes it"
                )
            present = names is not None
        else:
            directory = Path(directory)
            present = directory.is_dir()
        if not present:
            # a local path names the host: on a cluster, the set may be on some nodes' disks only
            where = "" if is_url(directory) else f" on {socket.gethostname()}"
            raise ShardsNotFoundError(
                f"shard directory '{redact(directory)}' does not exist{where}. {_how_to_build(directory)}"
            )
        shards = cls(directory, {}, access, _names=names)
        text = shards._read_text(MANIFEST_NAME)
        if text is not None:
            try:
                shards.manifest = json.loads(text)
            except ValueError as err:
                raise ShardsUnfitError(
                    f"{redact(join(directory, MANIFEST_NAME))} is not valid JSON ({err}); rebuild or fix the shard set"
                ) from err
        if is_url(directory):  # what a cached download is checked against
            shards.access = dataclasses.replace(
                access,
                checksums={
                    str(join(directory, s["file"])): s["sha256"]
                    for split in shards.manifest.get("splits", {}).values()
                    for s in split.get("shards", [])
                    if s.get("sha256")
                },
            )
        return shards

    def _read_text(self, name: str) -> str | None:
        """A file of the set as text; None when it is not there."""
        if not is_url(self.directory):
            path = Path(self.directory) / name
            return path.read_text() if path.is_file() else None
        if name not in self._listing():
            return None
        fs, path = filesystem(str(join(self.directory, name)), self.access.storage_options)
        return fs.cat_file(path).decode()

    @contextlib.contextmanager
    def _tar(self, url: str):
        """A shard as a TarFile: local ones with random access (headers only are read), remote ones
        as a stream read once front to back."""
        if not is_url(url):
            with tarfile.open(url) as tar:
                yield tar
            return
        with open_shard(url, self.access) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar

    def _listing(self) -> dict[str, int | None]:
        """The files in the set's directory and their sizes (one listing, not a request per shard; a
        remote set's once per run: evaluations do not ask the store again)."""
        if not is_url(self.directory):
            return list_names(self.directory) or {}
        if self._names is None:
            self._names = list_names(self.directory, self.access.storage_options) or {}
        return self._names

    def urls(self, split: str) -> list[str]:
        """Shard files of a split: from the manifest, else every `<split>-*.tar` in the directory."""
        listed = self.manifest.get("splits", {}).get(split, {}).get("shards")
        present = self._listing()
        names = (
            [s["file"] for s in listed]
            if listed
            else sorted(n for n in present if n.startswith(f"{split}-") and n.endswith(".tar"))
        )
        if not names:
            raise ShardsNotFoundError(
                f"no shards for split '{split}' in '{redact(self.directory)}' (expected files {split}-000000.tar ...). "
                + _how_to_build(self.directory)
            )
        missing = [redact(join(self.directory, n)) for n in names if n not in present]
        if missing:
            raise ShardsNotFoundError(f"shards listed in the manifest are missing: {', '.join(missing)}")
        return [str(join(self.directory, n)) for n in names]

    def sample_indexes(self, split: str) -> list[ShardIndex] | None:
        """Each shard's sample index (data/sample_index.py), in urls(split)'s order; None when a
        shard has none. An index that does not fit its shard (another size) is refused by name."""
        if split not in self._indexes:
            present, indexes = self._listing(), []
            for url in self.urls(split):
                name = index_name(url.rsplit("/", 1)[-1])
                if name not in present:
                    indexes = None
                    break
                where = redact(join(self.directory, name))
                index = ShardIndex.from_json(self._read_text(name), where)
                size = present.get(url.rsplit("/", 1)[-1])
                if size is not None and size != index.bytes:
                    raise ShardsUnfitError(stale_index(where, index.bytes, size, redact(self.directory)))
                indexes.append(index)
            self._indexes[split] = indexes
        return self._indexes[split]

    def num_samples(self, split: str) -> int | None:
        """From the manifest; without one, counted from the tar headers (shards from other tools)."""
        listed = self.manifest.get("splits", {}).get(split, {}).get("samples")
        if listed is not None or self.manifest.get("splits"):
            return listed
        if split not in self._counted:  # a scan of every header: once per split, not per evaluation
            keys = set()
            for url in self.urls(split):
                with self._tar(url) as tar:
                    keys.update((url, m.name.partition(".")[0]) for m in tar if m.isfile())
            self._counted[split] = len(keys)
        return self._counted[split]

    def feature_dim(self) -> int | None:
        """From the manifest; without one, the width of the first train sample's regions.npy."""
        dim = self.manifest.get("features", {}).get("dim")
        if dim is not None or self.manifest:
            return dim
        for url in self.urls("train"):
            with self._tar(url) as tar:
                for member in tar:
                    if member.name.endswith(".regions.npy"):
                        regions = np.load(io.BytesIO(tar.extractfile(member).read()), allow_pickle=False)
                        return int(regions.shape[1]) if regions.ndim == 2 else None
        return None

    def vocab(self, cache_dir: Path, min_count: int = 1, also: tuple[ShardSet, ...] = ()) -> Vocab:
        """The set's vocab.json, else one built from the train captions and cached in `cache_dir`.
        With `min_count` > 1 (words seen fewer times become <unk>, as captioning papers do) it is
        always built from the train captions: vocab.json keeps no counts. `also`: other sets a job
        trains on (L2C's single-image captions), whose train captions join the vocabulary."""
        name = "vocab" + (f"-min{min_count}" if min_count > 1 else "") + ("-streams" if also else "")
        cached = cache_dir / (name + ".json")
        own = self._read_text(VOCAB_NAME) if min_count == 1 and not also else None
        if own is not None:
            return self._vocab_of(own, join(self.directory, VOCAB_NAME))
        if cached.is_file():
            return self._vocab_of(cached.read_text(), cached)
        vocab = Vocab.build(
            itertools.chain(self.train_captions(), *(other.train_captions() for other in also)), min_count
        )
        cache_dir.mkdir(parents=True, exist_ok=True)
        vocab.save(cached)
        return vocab

    @staticmethod
    def _vocab_of(text: str, where: str | Path) -> Vocab:
        try:
            return Vocab.from_json(text, redact(where))
        except ValueError as err:
            raise ShardsUnfitError(str(err)) from None

    def train_captions(self):
        """Every caption of the train split, in shard order (read from the JSON members only)."""
        from vldist.data.shard_stream import shard_samples
        from vldist.data.skips import skipped

        samples = shard_samples(self.urls("train"), skipped, lambda n: n.endswith(".json"), self.access)
        for sample in samples:
            yield from json.loads(sample["json"]).get("captions", [])
