"""A per-node cache of remote shards (data.cache_dir): each shard downloaded once per node, whatever
the number of local ranks and loader workers, and read from local disk after that.

One file lock per shard makes the download once-only: the first process to take it downloads
(into <entry>.partial, through ResumableReader, hashing as it writes), checks the size and the
manifest's sha256, and renames the file into place; the others wait on the lock and find it done.
A sidecar (<entry>.ok: size, sha256 and mtime of the checked file) lets later reads skip hashing,
and a file changed since (another size or mtime) is fetched again. Entries are evicted least
recently used (the access time, set on each use: the modification time stays the check's) to keep
the cache under data.cache_max_gb. flock-based
locks are released by the kernel when their holder dies, so a killed download never blocks the
cache; they are only reliable on local disk, so the cache belongs on node-local storage."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from vldist.store.location import redact
from vldist.store.retry import ShardUnavailable

_CHUNK = 1 << 20
_PARTS = (".partial", ".lock", ".ok")


class ShardCorrupt(ShardUnavailable):
    """A downloaded shard's size or sha256 differs from what the store or the manifest says."""


@dataclass(frozen=True)
class CacheConfig:
    directory: str
    max_bytes: int


class ShardCache:
    def __init__(self, config: CacheConfig):
        self.directory = Path(config.directory).expanduser()
        self.max_bytes = config.max_bytes

    def entry(self, url: str) -> Path:
        """Where `url` is cached: named by the URL (credentials left out) and its file name."""
        digest = hashlib.sha256(redact(url).encode()).hexdigest()[:16]
        return self.directory / f"{digest}-{url.rstrip('/').rsplit('/', 1)[-1]}"

    def fetch(self, url: str, download, sha256: str | None = None) -> Path:
        """The local copy of `url`, downloaded first if it is not there or no longer checks out.
        `download(url)` opens the remote object for reading (a ResumableReader)."""
        entry = self.entry(url)
        if self._checked(entry, sha256):
            _touch(entry)
            return entry
        self.directory.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{entry}.lock"):
            if not self._checked(entry, sha256):  # another rank or worker may have fetched it meanwhile
                self._download(url, entry, download, sha256)
        _touch(entry)
        with FileLock(str(self.directory / ".evict.lock")):
            self.evict(keep=entry)
        return entry

    def _checked(self, entry: Path, sha256: str | None) -> bool:
        try:
            stat, mark = entry.stat(), json.loads(Path(f"{entry}.ok").read_text())
        except (OSError, ValueError):
            return False
        return (mark.get("size"), mark.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns) and (
            sha256 is None or mark.get("sha256") == sha256
        )

    def _download(self, url: str, entry: Path, download, sha256: str | None) -> None:
        Path(f"{entry}.ok").unlink(missing_ok=True)
        partial = Path(f"{entry}.partial")
        digest = hashlib.sha256()
        with download(url) as source, open(partial, "wb") as out:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
            expected_size = getattr(source, "size", None)
            out.flush()
            os.fsync(out.fileno())
        size = partial.stat().st_size
        problem = (
            f"{size} bytes, the store says {expected_size}"
            if expected_size not in (None, size)
            else f"sha256 {digest.hexdigest()[:12]}..., the manifest says {sha256[:12]}..."
            if sha256 is not None and digest.hexdigest() != sha256
            else None
        )
        if problem:
            partial.unlink()
            raise ShardCorrupt(f"{redact(url)}: the download does not check out ({problem})")
        os.replace(partial, entry)
        stat = entry.stat()
        Path(f"{entry}.ok").write_text(
            json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()})
        )

    def evict(self, keep: Path) -> list[Path]:
        """Remove least recently used entries until the cache holds at most max_bytes (never
        `keep`, the entry just fetched, nor a download in progress); the removed entries."""
        entries = [
            p
            for p in self.directory.iterdir()
            if p.is_file() and not p.name.endswith(_PARTS) and not p.name.startswith(".")
        ]
        total = sum(p.stat().st_size for p in entries)
        removed = []
        for path in sorted(entries, key=lambda p: p.stat().st_atime_ns):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            total -= path.stat().st_size
            Path(f"{path}.ok").unlink(missing_ok=True)
            path.unlink(missing_ok=True)  # a process reading it keeps its open file (POSIX)
            removed.append(path)
        return removed


def _touch(entry: Path) -> None:
    """Mark `entry` used now: its access time, set explicitly (noatime and relatime mounts only stop
    the automatic updates); its modification time is what the sidecar checks, so it stays."""
    stat = entry.stat()
    os.utime(entry, ns=(time.time_ns(), stat.st_mtime_ns))
