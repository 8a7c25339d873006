"""A remote shard read front to back that survives the network: when a connection drops, resets or
ends early, the object is opened again and the read goes on at the byte it had reached (a ranged
read where the filesystem can seek, else the bytes before it are read again and dropped). The tar
parser above sees the same bytes as from an unbroken read, so no sample is lost or repeated and
every rank's stream stays what it would have been.

The same reader reads one range of an object (start, end): the samples an index points at
(data/sample_reader.py), one ranged GET, resumed the same way if it breaks."""

from __future__ import annotations

import io
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

from vldist.errors import StoreLost
from vldist.store.access import StoreAccess
from vldist.store.cache import ShardCache
from vldist.store.location import filesystem, is_url, redact
from vldist.store.retry import ReadInterrupted, RetryPolicy, ShardUnavailable, transient

log = logging.getLogger("vldist.data")
_SKIP_CHUNK = 1 << 20


class ResumableReader(io.RawIOBase):
    """Bytes of one object at `url` (or of its range [start, end)), resumed at the current offset
    after transient errors."""

    def __init__(
        self,
        url: str,
        access: StoreAccess | None = None,
        sleep: Callable[[float], None] = time.sleep,
        start: int = 0,
        end: int | None = None,
    ):
        super().__init__()
        self.url, self.access, self.sleep = url, access or StoreAccess(), sleep
        self.position = start
        self.size: int | None = end  # where the read ends: the object's size unless a range was asked
        self.ranged = end is not None
        self.reopened = 0  # times the object was opened again after an error
        self._file = None
        self._rng = random.Random()  # jitter of its own: the data streams' generators stay untouched
        self._http = urlsplit(url).scheme in ("http", "https")

    def readable(self) -> bool:
        return True

    def _open(self):
        fs, path = filesystem(self.url, self.access.storage_options)
        if self.size is None:
            self.size = fs.size(path)  # to tell an early end from the object's end
        # over HTTP one streaming GET (block_size=0), which servers that ignore Range serve too
        # (a range is then reached by reading the bytes before it: give HTTP sets a data.cache_dir);
        # elsewhere a seek to resume (a ranged read), with read-ahead blocks for a whole object, and
        # without for a range, read as asked (s3fs would fetch a 50 MiB block for a 20 kB sample)
        if self._http:
            options = {"block_size": 0}
        else:
            options = {"cache_type": "none" if self.ranged else "readahead"}
        stream = fs.open(path, "rb", **options)
        if self.position:
            if self._http:
                left = self.position
                while left:
                    chunk = stream.read(min(left, _SKIP_CHUNK))
                    if not chunk:
                        raise ReadInterrupted(
                            f"ended after {self.position - left} of the {self.position} bytes to skip"
                        )
                    left -= len(chunk)
            else:
                stream.seek(self.position)
        return stream

    def readinto(self, buffer) -> int:
        failures = 0
        while True:
            try:
                if self._file is None:
                    self._file = self._open()
                wanted = len(buffer) if not self.ranged else min(len(buffer), self.size - self.position)
                data = self._file.read(wanted) if wanted > 0 else b""
                if not data and self.size is not None and self.position < self.size:
                    raise ReadInterrupted(f"ended at byte {self.position} of {self.size}")
            except Exception as error:  # noqa: BLE001 - sorted below: transient ones are tried again
                self._drop()
                failures += 1
                if not transient(error):
                    raise
                if failures > self.access.retry.retries:
                    last = error.__cause__ if isinstance(error, FileNotFoundError) and error.__cause__ else error
                    tried = (
                        f"{failures} tries failed at byte {self.position}{f' of {self.size}' if self.size else ''}; "
                        f"last: {type(last).__name__}: {last}"
                    )
                    if not self._store_answers():
                        raise StoreLost(
                            f"the store of {redact(self.url)} stopped answering ({tried}; and its directory did not "
                            "answer either). Check that the store is up, the network from this machine and the "
                            "credentials; the checkpoints written before are whole: train.resume=latest carries on "
                            "once the store is back"
                        ) from None
                    raise ShardUnavailable(f"{redact(self.url)}: {tried}") from None
                wait = self.access.retry.wait(failures, self._rng)
                log.debug(
                    "reading %s: %s at byte %d, again in %.1f s",
                    redact(self.url),
                    type(error).__name__,
                    self.position,
                    wait,
                )
                self.sleep(wait)
                self.reopened += 1
                continue
            buffer[: len(data)] = data
            self.position += len(data)
            return len(data)

    def _store_answers(self) -> bool:
        """Whether the shard's directory still answers (a few quick tries): tells a lost shard,
        skipped, from a lost store, which ends the run."""
        parent = self.url.rstrip("/").rsplit("/", 1)[0]
        quick = RetryPolicy(retries=2, first_wait=0.5, max_wait=2.0)
        for attempt in range(quick.retries + 1):
            try:
                fs, path = filesystem(parent, self.access.storage_options)
                fs.invalidate_cache()
                return fs.isdir(path)
            except Exception as error:  # noqa: BLE001 - sorted: a lasting error is an answer
                if not transient(error):
                    return True
                self.sleep(quick.wait(attempt + 1, self._rng))
        return False

    def _drop(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
                pass
            self._file = None

    def close(self) -> None:
        self._drop()
        super().close()

    def __repr__(self) -> str:  # WebDataset puts the stream into error messages: no credentials there
        return f"<ResumableReader {redact(self.url)} at byte {self.position}>"


def open_shard(where: str | Path, access: StoreAccess | None = None) -> IO[bytes]:
    """A shard opened for reading front to back: a local file as it is, a URL through ResumableReader,
    or, with data.cache_dir, from this node's cached copy (store/cache.py)."""
    if not is_url(where):
        return open(where, "rb")
    access = access or StoreAccess()
    if access.cache is not None:  # read from this node's copy, downloaded once
        url = str(where)
        local = ShardCache(access.cache).fetch(url, lambda u: ResumableReader(u, access), access.checksums.get(url))
        return open(local, "rb")
    return io.BufferedReader(ResumableReader(str(where), access), buffer_size=_SKIP_CHUNK)
