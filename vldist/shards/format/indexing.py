"""`python -m vldist.shards index DIR|URL`: add the sample index (data/sample_index.py) to every
shard of a set written before indexes existed, or by another tool. A local shard's headers are
read by seeking over its data; a remote one is read front to back once (its data is not kept).
Shards that have an index that fits them are left alone, so the command can be rerun after an
interruption; `verify` checks every index against its shard."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from vldist.data.sample_index import ShardIndex, index_tar, index_tar_members
from vldist.file_integrity import write_text_atomic
from vldist.shards.format.layout import MANIFEST_NAME, index_name
from vldist.store.access import StoreAccess
from vldist.store.location import filesystem, is_url, join, list_names
from vldist.store.reader import open_shard


@dataclass
class Indexed:
    written: list[str]  # shards indexed now
    kept: list[str]  # shards whose index was there and fits


def shard_names(listing: dict, manifest: dict | None) -> list[str]:
    """The set's shards: the manifest's, else every <split>-NNNNNN.tar."""
    if manifest and manifest.get("splits"):
        return [s["file"] for split in manifest["splits"].values() for s in split.get("shards", [])]
    return sorted(n for n in listing if n.endswith(".tar") and "-" in n)


def build_index(where: str | Path, name: str, access: StoreAccess) -> ShardIndex:
    """The index of shard `name` of the set at `where`, from its tar headers."""
    path = join(where, name)
    if not is_url(where):
        with tarfile.open(path) as tar:  # random access: the headers only
            return index_tar_members(tar, name, Path(path).stat().st_size)
    with open_shard(str(path), access) as stream:
        return index_tar(stream, name)


def index_set(where: str | Path, access: StoreAccess | None = None, force: bool = False) -> Indexed:
    """Write the missing (with `force`, every) shard index of the set at `where`."""
    access = access or StoreAccess()
    listing = list_names(where, access.storage_options)
    if listing is None:
        raise FileNotFoundError(f"no shard set at {where}")
    manifest = json.loads(_read(where, MANIFEST_NAME, access)) if MANIFEST_NAME in listing else None
    done = Indexed([], [])
    for name in shard_names(listing, manifest):
        if name not in listing:
            raise FileNotFoundError(f"{name} is listed in the manifest of {where} but missing")
        if not force and index_name(name) in listing:
            existing = ShardIndex.from_json(_read(where, index_name(name), access), str(join(where, index_name(name))))
            if existing.bytes == listing[name] or listing[name] is None:
                done.kept.append(name)
                continue
        _write(where, index_name(name), build_index(where, name, access).to_json(), access)
        done.written.append(name)
    return done


def _read(where, name: str, access: StoreAccess) -> str:
    if not is_url(where):
        return (Path(where) / name).read_text()
    fs, path = filesystem(str(join(where, name)), access.storage_options)
    return fs.cat_file(path).decode()


def _write(where, name: str, text: str, access: StoreAccess) -> None:
    if not is_url(where):
        write_text_atomic(Path(where) / name, text)
        return
    fs, path = filesystem(str(join(where, name)), access.storage_options)
    fs.pipe_file(path, text.encode())  # one PUT: an object store never shows half of it
