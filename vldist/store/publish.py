"""Putting a shard set into a store so that a reader never takes a partial set for a whole one: a
marker object (.incomplete) goes first, which readers refuse (ShardSet.open says the set is being
written), then every file, then manifest.json, and the marker is removed last. Shards can go up
while the rest of the set is still being built (upload_while_building). An interrupted upload is
resumed by the same command: files already in the store with the local size are not sent again."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path

from vldist.shards.format.layout import MANIFEST_NAME
from vldist.store.access import StoreAccess
from vldist.store.location import filesystem, list_names, redact

log = logging.getLogger("vldist.shards")
INCOMPLETE = ".incomplete"  # present in a set while it is written


class SetPublisher:
    """One upload of a set to `url`: begin() marks it incomplete, send() puts files, finish() puts
    the manifest and removes the marker."""

    def __init__(self, url: str, access: StoreAccess | None = None, overwrite: bool = False):
        self.url = url.rstrip("/")
        options = (access or StoreAccess()).storage_options
        self.fs, self.root = filesystem(self.url, options)
        self.there = list_names(self.url, options) or {}
        self.overwrite = overwrite
        self.sent = 0

    def begin(self) -> None:
        there = self.there
        if MANIFEST_NAME in there and INCOMPLETE not in there and not self.overwrite:
            raise FileExistsError(f"{redact(self.url)} already holds a shard set; pass --overwrite to replace it")
        self.fs.pipe_file(
            f"{self.root}/{INCOMPLETE}", b"a shard set is being written here; rerun the command that writes it\n"
        )
        if self.overwrite and INCOMPLETE not in there:  # replacing a whole set: its old files go, the manifest first
            for name in sorted(there, key=lambda n: n != MANIFEST_NAME):
                self.fs.rm_file(f"{self.root}/{name}")
            self.there = {}

    def send(self, path: Path) -> None:
        """Upload one finished file of the set, unless the store has it with this size already."""
        size = path.stat().st_size
        if self.there.get(path.name) == size:
            return  # sent before an interruption, or earlier in this upload
        self.fs.put_file(str(path), f"{self.root}/{path.name}")
        self.there[path.name] = size
        self.sent += 1

    def finish(self, local: Path) -> int:
        """Send what is left of the set in `local`, the manifest last; the number of files sent."""
        for path in sorted(
            p for p in local.iterdir() if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".tmp")
        ):
            self.send(path)
        self.fs.put_file(str(local / MANIFEST_NAME), f"{self.root}/{MANIFEST_NAME}")
        self.sent += 1
        self.fs.rm_file(f"{self.root}/{INCOMPLETE}")
        log.info("published %s: %d files", redact(self.url), self.sent)
        return self.sent


def publish_set(local: Path, url: str, access: StoreAccess | None = None, overwrite: bool = False) -> int:
    """Upload the set in `local` to `url`, manifest last; the number of files sent."""
    publisher = SetPublisher(url, access, overwrite)
    publisher.begin()
    return publisher.finish(local)


@contextmanager
def upload_while_building(
    local: Path, url: str, access: StoreAccess | None = None, overwrite: bool = False, every_s: float = 1.0
):
    """While the block builds a set in `local`, upload each shard (<split>-NNNNNN.tar) as soon as
    the writer renames it into place (vldist/shards/format/writer.py: a .tmp until it is whole);
    yields the SetPublisher, whose finish() the caller runs after the block once the set is complete. A watcher
    thread rather than a hook in every writer: synth, synth-pairs and each converter write sets
    their own way, and all of them finish a shard by renaming it."""
    publisher = SetPublisher(url, access, overwrite)
    publisher.begin()
    stop = threading.Event()
    failure: list[BaseException] = []

    def watch() -> None:
        while True:
            stopping = stop.wait(every_s)
            try:
                for path in sorted(local.glob("*.tar")) if local.is_dir() else []:
                    publisher.send(path)
            except BaseException as err:  # noqa: BLE001 - handed to the building thread below
                failure.append(err)
                return
            if stopping:
                return

    watcher = threading.Thread(target=watch, name="vldist-shard-upload", daemon=True)
    watcher.start()
    try:
        yield publisher
    finally:
        stop.set()
        watcher.join()
    if failure:
        raise failure[0]
