"""Putting a shard set built on local disk into a store, so that a reader never takes a partial set
for a whole one: a marker object (.incomplete) goes first, which readers refuse (ShardSet.open says
the set is being written), then every file, then manifest.json, and the marker is removed last.
An interrupted upload is resumed by the same command: files already in the store with the local
size are not sent again."""

from __future__ import annotations

import logging
from pathlib import Path

from vldist.shards.format.layout import MANIFEST_NAME
from vldist.store.access import StoreAccess
from vldist.store.location import filesystem, redact

log = logging.getLogger("vldist.shards")
INCOMPLETE = ".incomplete"  # present in a set while it is written


def remote_names(fs, root: str) -> dict[str, int]:
    """{file name: size} of the objects directly under `root` ({} when there are none)."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") or 0 for e in entries if e.get("type") != "directory"}


def publish_set(local: Path, url: str, access: StoreAccess | None = None, overwrite: bool = False) -> int:
    """Upload the set in `local` to `url`, manifest last; the number of files sent."""
    fs, root = filesystem(url, (access or StoreAccess()).storage_options)
    there = remote_names(fs, root)
    if MANIFEST_NAME in there and INCOMPLETE not in there and not overwrite:
        raise FileExistsError(f"{redact(url)} already holds a shard set; pass --overwrite to replace it")
    fs.pipe_file(f"{root}/{INCOMPLETE}", b"a shard set is being written here; rerun the command that writes it\n")
    if overwrite and INCOMPLETE not in there:  # replacing a whole set: its old files go, the manifest first
        for name in sorted(there, key=lambda n: n != MANIFEST_NAME):
            fs.rm_file(f"{root}/{name}")
        there = {}
    files = sorted(p for p in local.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    sent = 0
    for path in [*files, local / MANIFEST_NAME]:
        if path.name != MANIFEST_NAME and there.get(path.name) == path.stat().st_size:
            continue  # sent before an interruption
        fs.put_file(str(path), f"{root}/{path.name}")
        sent += 1
    fs.rm_file(f"{root}/{INCOMPLETE}")
    log.info("published %s: %d files", redact(url), sent)
    return sent
