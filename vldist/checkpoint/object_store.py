"""Checkpoints in object storage (`output.checkpoint_dir=s3://bucket/prefix`, any fsspec store).

A run still commits each checkpoint on local disk first (`<output.dir>/checkpoints`, atomically,
checksummed: format.py); rank 0 then uploads it: every file, then files.json, then COMPLETE
last. A reader takes only a directory with COMPLETE, so a partial upload (a run killed meanwhile,
a store that failed) is never loaded; the store's previous checkpoint stays the newest complete
one. An older copy of the same name (`best`) loses its COMPLETE before its files are replaced.

Reading: a checkpoint the local disk lacks (another machine, a lost disk) is downloaded into a
local directory of the same name, checked file by file against files.json, and only then marked
complete there, so a download cut short is never loaded either.

Uploads and downloads go through fsspec (s3fs for s3://), the same layer the shards use;
credentials come from the environment and never appear in a message (redact)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

from vldist.checkpoint.format import FILES, MARKER, STEP_PREFIX, chosen_name, is_complete
from vldist.errors import CheckpointError
from vldist.file_integrity import sha256_file
from vldist.store.location import filesystem, is_url, redact


class CheckpointStore:
    """The checkpoints under one store URL."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options)

    def where(self, name: str) -> str:
        return redact(f"{self.url}/{name}")

    # ------------------------------------------------------------------ writing

    def upload(self, local: Path) -> None:
        """Put the committed checkpoint directory `local` under its name, COMPLETE last."""
        local = Path(local)
        if not is_complete(local):
            raise CheckpointError(f"'{local}' is not a complete checkpoint; only committed checkpoints are uploaded")
        target = f"{self.root}/{local.name}"
        self._remove(target)
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.name not in (MARKER, FILES))
        for path in files:
            self.fs.put_file(str(path), f"{target}/{path.relative_to(local).as_posix()}")
        self.fs.put_file(str(local / FILES), f"{target}/{FILES}")
        self.fs.put_file(str(local / MARKER), f"{target}/{MARKER}")

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest `keep_last` complete step checkpoints, and every incomplete
        one (what a killed upload left: no upload is in flight when the uploader prunes)."""
        complete = self.step_checkpoints()
        doomed = complete[:-keep_last] + [n for n in self._step_names() if n not in complete]
        for name in doomed:
            self._remove(f"{self.root}/{name}")

    def _remove(self, target: str) -> None:
        if self.fs.exists(f"{target}/{MARKER}"):
            self.fs.rm_file(f"{target}/{MARKER}")  # first: from here on no reader takes it
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    # ------------------------------------------------------------------ reading

    def _step_names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [
            e.rstrip("/").rsplit("/", 1)[-1]
            for e in entries
            if e.rstrip("/").rsplit("/", 1)[-1].startswith(STEP_PREFIX)
        ]

    def step_checkpoints(self) -> list[str]:
        """Names of the complete step checkpoints in the store, oldest first."""
        self.fs.invalidate_cache()  # another process may have written since this one listed
        names = [n for n in self._step_names() if self.fs.exists(f"{self.root}/{n}/{MARKER}")]
        return sorted(names, key=lambda n: int(n[len(STEP_PREFIX) :]))

    def has(self, name: str) -> bool:
        return self.fs.exists(f"{self.root}/{name}/{MARKER}")

    def read_file(self, name: str, relative: str) -> bytes:
        """One small file of checkpoint `name` (meta.json, config.yaml), without downloading the rest."""
        return self.fs.cat_file(f"{self.root}/{name}/{relative}")

    def download(self, name: str, local: Path) -> Path:
        """The store's complete checkpoint `name` as the local checkpoint directory `local`."""
        local = Path(local)
        if is_complete(local):
            return local
        if not self.has(name):
            raise CheckpointError(f"no complete checkpoint at {self.where(name)}")
        # Its own temporary name: the first rank of every node may download at once, and on a
        # filesystem the nodes share they would otherwise write into one directory.
        tmp = local.with_name(f".{local.name}.download-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        source = f"{self.root}/{name}"
        listing = json.loads(self.fs.cat_file(f"{source}/{FILES}"))
        for relative, expected in listing.items():
            path = tmp / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{source}/{relative}", str(path))
            if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"{self.where(name)}/{relative} differs from its record in {FILES}; "
                    "the checkpoint in the store is damaged"
                )
        (tmp / FILES).write_text(json.dumps(listing, indent=1) + "\n")
        (tmp / MARKER).write_text("ok\n")
        if is_complete(local):  # another node's download finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return local
        if local.exists():  # an incomplete leftover of the same name
            shutil.rmtree(local)
        os.replace(tmp, local)
        return local


def cache_directory(url: str) -> Path:
    """Where checkpoints downloaded for evaluation or export are kept: one directory per URL."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vldist" / "checkpoints"
    return base / hashlib.sha256(redact(url).encode()).hexdigest()[:16]


def local_checkpoint(where: str, storage_options: dict | None = None, which: str | None = None) -> Path:
    """A checkpoint for `vldist.evaluate`, `vldist.caption` or `vldist.export` given a store URL:
    the checkpoint itself, or one of a checkpoint directory's (`which`: best, latest or step-N;
    default: best, else the newest), or of a run's URL holding `checkpoints/`; downloaded into the
    local cache and returned there."""
    if not is_url(where):
        return Path(where)
    store = CheckpointStore(where, storage_options)
    if store.fs.exists(f"{store.root}/{MARKER}"):  # the URL of one checkpoint
        parent, name = store.url.rsplit("/", 1)
        return CheckpointStore(parent, storage_options).download(name, cache_directory(where) / name)
    for candidate in (store, CheckpointStore(f"{store.url}/checkpoints", storage_options)):
        steps = candidate.step_checkpoints()
        best = ["best"] if candidate.has("best") else []
        if not steps and not best:
            continue
        name = (best or steps[-1:])[0] if which is None else chosen_name(which, bool(best), steps)
        if name is None:
            raise CheckpointError(
                f"--checkpoint {which}: no such complete checkpoint at {redact(candidate.url)} "
                f"(available: {', '.join(best + steps)})"
            )
        return candidate.download(name, cache_directory(candidate.url) / name)
    raise CheckpointError(f"no complete checkpoint at {redact(where)} (nor its best or step checkpoints)")
