"""`python -m vldist.shards index DIR|URL`: add the sample index (data/sample_index.py) to every
shard of a set written before indexes existed, or by another tool. A local shard's headers are
read by seeking over its data; a remote one is read front to back once (its data is not kept).
Shards that have an index that fits them are left alone, so the command can be rerun after an
interruption; an index that no longer fits its shard (or is damaged) is replaced. `verify` checks
every index against its shard.

A shard cut short (an interrupted copy or upload) is refused by name, with the byte where it
breaks, before any index is written: its index would leave samples out of training that the
manifest counts. With `partial` its whole samples are indexed, the index says where the shard
breaks (`"cut"`), and training reads those samples only (the epoch's length follows the index).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vldist.data.sample_index import Cut, ForwardReader, ShardIndex, scan_tar
from vldist.errors import OutputNotWritable, ShardsUnfitError
from vldist.file_integrity import write_text_atomic
from vldist.shards.format.layout import MANIFEST_NAME, index_name
from vldist.store.access import StoreAccess
from vldist.store.location import filesystem, is_url, join, list_names, redact
from vldist.store.reader import open_shard


@dataclass
class Indexed:
    written: list[str]  # shards indexed now
    kept: list[str]  # shards whose index was there and fits
    replaced: list[str] = field(default_factory=list)  # of `written`: their index no longer fitted them
    partial: list[str] = field(default_factory=list)  # of `written`: cut short, their whole samples indexed (lines)


def shard_names(listing: dict, manifest: dict | None) -> list[str]:
    """The set's shards: the manifest's, else every <split>-NNNNNN.tar."""
    if manifest and manifest.get("splits"):
        return [s["file"] for split in manifest["splits"].values() for s in split.get("shards", [])]
    return sorted(n for n in listing if n.endswith(".tar") and "-" in n)


def scan_shard(where: str | Path, name: str, access: StoreAccess) -> tuple[ShardIndex, Cut | None]:
    """The index of shard `name` of the set at `where`, from its tar headers, and where the shard
    breaks (None: it is whole)."""
    path = join(where, name)
    if not is_url(where):
        with open(path, "rb") as f:  # random access: the headers only
            return scan_tar(f, name)
    with open_shard(str(path), access) as stream:
        return scan_tar(ForwardReader(stream), name)


def build_index(where: str | Path, name: str, access: StoreAccess) -> ShardIndex:
    """The index of shard `name`; a shard cut short is refused (ShardsUnfitError, what to do)."""
    index, cut = scan_shard(where, name, access)
    if cut is not None:
        raise ShardsUnfitError(cut_short(where, name, index, cut, None))
    return index


def cut_short(where, name: str, index: ShardIndex, cut: Cut, listed: int | None) -> str:
    """The refusal of a shard cut short: where it breaks, and the two ways on."""
    return (
        f"{redact(join(where, name))} is {cut.what}: {cut.how}; no index was written. "
        f"`python -m vldist.shards verify {redact(where)}` lists every problem: copy or build that shard again, "
        f"or `python -m vldist.shards index {redact(where)} --partial` indexes its {len(index)} whole samples "
        f"before byte {cut.at} ({left_out(index, listed)} then left out of training)"
    )


def left_out(index: ShardIndex, listed: int | None) -> str:
    """What a partial index leaves out, against the manifest's count of the shard when there is one."""
    if listed is None:
        return f"the samples from byte {index.cut} on are"
    return f"{max(listed - len(index), 0)} of the manifest's {listed} samples of that shard are"


def index_set(
    where: str | Path, access: StoreAccess | None = None, force: bool = False, partial: bool = False
) -> Indexed:
    """Write the missing (with `force`, every) shard index of the set at `where`. Every shard is
    read before any index is written, so a shard cut short (without `partial`) leaves the set as
    it was; Ctrl-C writes the indexes of the whole shards read so far (a rerun goes on from them)."""
    access = access or StoreAccess()
    listing = list_names(where, access.storage_options)
    if listing is None:
        raise FileNotFoundError(f"no shard set at {redact(where)}")
    manifest = json.loads(_read(where, MANIFEST_NAME, access)) if MANIFEST_NAME in listing else None
    listed = {
        s["file"]: s.get("samples") for split in (manifest or {}).get("splits", {}).values() for s in split["shards"]
    }
    done, todo = Indexed([], []), []
    try:
        for name in shard_names(listing, manifest):
            if name not in listing:
                raise FileNotFoundError(f"{name} is listed in the manifest of {redact(where)} but missing")
            if index_name(name) in listing:
                if not force and _fits(where, name, listing[name], access):
                    done.kept.append(name)
                    continue
                if not force:
                    done.replaced.append(name)
            index, cut = scan_shard(where, name, access)
            if cut is not None:
                if not partial:
                    raise ShardsUnfitError(cut_short(where, name, index, cut, listed.get(name)))
                done.partial.append(
                    f"{name} is {cut.what} ({cut.how}): indexed its {len(index)} whole samples before byte "
                    f"{cut.at}; {left_out(index, listed.get(name))} left out of training"
                )
            todo.append((name, index))
    except KeyboardInterrupt:
        _write_all(where, [(n, i) for n, i in todo if i.cut is None], access, done)
        raise
    _write_all(where, todo, access, done)
    return done


def _fits(where, name: str, size: int | None, access: StoreAccess) -> bool:
    """Whether the shard's index describes it (its size: a damaged index does not fit)."""
    try:
        existing = ShardIndex.from_json(_read(where, index_name(name), access), str(join(where, index_name(name))))
    except (ShardsUnfitError, ValueError):  # damaged, or not text
        return False
    return size is None or existing.bytes == size


def _write_all(where, todo: list[tuple[str, ShardIndex]], access: StoreAccess, done: Indexed) -> None:
    for name, index in todo:
        _write(where, index_name(name), index.to_json(), access)
        done.written.append(name)


def _read(where, name: str, access: StoreAccess) -> str:
    if not is_url(where):
        return (Path(where) / name).read_text()
    fs, path = filesystem(str(join(where, name)), access.storage_options)
    return fs.cat_file(path).decode()


def _write(where, name: str, text: str, access: StoreAccess) -> None:
    if not is_url(where):
        try:
            write_text_atomic(Path(where) / name, text)
        except OSError as err:  # a read-only disk, no permission: said once, not as a traceback
            raise OutputNotWritable(
                f"cannot write the sample index {Path(where) / name}: {err.strerror or err}; no index was written. "
                f"Make {where} writable, or index a copy of the set on a disk you can write to"
            ) from None
        return
    fs, path = filesystem(str(join(where, name)), access.storage_options)
    try:
        fs.pipe_file(path, text.encode())  # one PUT: an object store never shows half of it
    except PermissionError as err:  # the store's credentials may read, not write
        raise OutputNotWritable(
            f"cannot write the sample index {redact(join(where, name))}: {err}. Use credentials that may write "
            "to the set (data.storage_options or the store's environment variables)"
        ) from None
