"""Where the embedded sets live, and building one there.

A job names an embedded set by its own name, `shards/synth` (data.shards' default) or
`shards/synth_pairs` (L2C), and that name stays in the job's config, metrics and checkpoints. Each
process resolves it on its own machine, the same way wherever it starts:

1. `./shards/synth` in the working directory, if it holds a whole set (its manifest.json), such as
   one `python -m vldist.shards synth --out shards/synth` wrote there (a checkout where the demo
   ran before keeps reading it, rather than building 1 GB again);
2. else `<data home>/synth` (`<data home>/synth_pairs`), built there on first use, once per
   machine. The data home is `$VLDIST_DATA_HOME` if set, else `$XDG_CACHE_HOME/vldist`, else
   `~/.cache/vldist`.

On several nodes each node resolves it in its own environment: with its own disk, each node's first
rank builds the set in its node's data home (the same bytes everywhere); with a home directory that
the nodes share, the first to come builds it and the others read it. A Ray worker resolves it with
the environment its node's `ray start` had (or the job's runtime_env env_vars), not in the working
directory Ray unpacks.

One process builds a set at a time (a lock file beside it, `<data home>/synth.lock`, removed when
the build ends); the set is written into `synth.partial/` and renamed to `synth` when whole, so
what stands at `synth` is always complete. Ctrl-C or a failure during the build removes the lock
file and `synth.partial/`: the next run builds the set from the start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from vldist.errors import Interrupted, OutputNotWritable
from vldist.shards.format.layout import MANIFEST_NAME

log = logging.getLogger("vldist.train")

DATA_HOME_ENV = "VLDIST_DATA_HOME"


@dataclass(frozen=True)
class EmbeddedSet:
    module: str  # where the builder is: builder(out_dir) writes the set at out_dir
    builder: str
    what: str  # in words, for the log and the messages
    size: str  # on disk, and the time a build takes: for the line that says it is being built
    time: str


# The embedded sets vldist generates itself, by the name a job gives them.
EMBEDDED_SETS: dict[str, EmbeddedSet] = {
    "shards/synth": EmbeddedSet(
        "vldist.shards.synthetic.synth",
        "build_synth",
        "the embedded synthetic dataset",
        "about 1 GB",
        "about a minute and a half",
    ),
    "shards/synth_pairs": EmbeddedSet(
        "vldist.shards.synthetic.pairs",
        "build_synth_pairs",
        "the embedded image-pair dataset (L2C)",
        "about 35 MB",
        "a few seconds",
    ),
}

_said: set[tuple[str, Path]] = set()  # (name, location) whose line this process has logged


def data_home() -> Path:
    """Where the embedded sets are built: $VLDIST_DATA_HOME, else $XDG_CACHE_HOME/vldist (an absolute
    XDG_CACHE_HOME only, as the XDG spec asks), else ~/.cache/vldist."""
    home = os.environ.get(DATA_HOME_ENV)
    if home:
        return Path(home).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if cache and Path(cache).is_absolute() else Path("~/.cache").expanduser()
    return base / "vldist"


def home_location(name: str) -> Path:
    """The embedded set `name` (shards/synth) in the data home: <data home>/synth."""
    return data_home() / Path(name).name


def is_whole(directory: Path) -> bool:
    return (directory / MANIFEST_NAME).is_file()  # written last: a set without it is not whole


def locate(name: str) -> Path:
    """Where this process reads the embedded set `name`: a whole set at `name` in the working
    directory, else the data home's (which may not be built yet). Logs the first time which it is."""
    here = Path(name).absolute()
    if is_whole(here):
        _say(
            name,
            here,
            "reading %s from %s (found in the working directory; elsewhere it is read from %s)",
            EMBEDDED_SETS[name].what,
            here,
            home_location(name),
        )
        return here
    home = home_location(name)
    if is_whole(home):
        _say(name, home, "reading %s from %s", EMBEDDED_SETS[name].what, home)
    return home


def _say(name: str, where: Path, message: str, *args) -> None:
    if (name, where) not in _said:
        _said.add((name, where))
        log.info(message, *args)


def built_where_read(directory: str, build_if_missing: bool) -> bool:
    """`directory` is an embedded set's name (shards/synth) that the job builds when absent: each
    process resolves it on its own machine (locate), and each node's first rank builds it there.
    With data.build_if_missing=false the name is a path like any other."""
    return directory in EMBEDDED_SETS and build_if_missing


def read_location(directory: str, build_if_missing: bool) -> str | Path:
    """Where a job reads the shard set it names `directory` (data.shards, another stream's set): an
    embedded set's name resolved on this machine (locate), any other as it is."""
    return locate(directory) if built_where_read(directory, build_if_missing) else directory


def ensure_built(name: str) -> Path:
    """The embedded set `name`, built in the data home if no whole set is found (locate). Two
    processes on one machine (two jobs started together, a job beside the tests) build it once: the
    second waits for the first, then reads its set. Ctrl-C during the build raises Interrupted, a
    failure OutputNotWritable (the data home cannot be written, or its disk is full) or the
    builder's own error; either way nothing of the build is left (no .partial, no lock file)."""
    where = locate(name)
    if is_whole(where):
        return where
    entry = EMBEDDED_SETS[name]
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _not_writable(entry, where, err, removed=False) from None
    lock = BuildLock(where.with_name(where.name + ".lock"))
    try:
        lock.acquire()
    except KeyboardInterrupt:  # Ctrl-C while another process builds it: that build goes on
        raise Interrupted(
            f"waiting for another process to build {entry.what} in {where} was interrupted; that build goes on"
        ) from None
    except OSError as err:
        raise _not_writable(entry, where, err, removed=False) from None
    try:
        if is_whole(where):  # built while this process waited for the lock
            _say(name, where, "reading %s from %s (built by another process meanwhile)", entry.what, where)
        else:
            _build(name, entry, where)
    finally:
        lock.release()
    return where


def _build(name: str, entry: EmbeddedSet, where: Path) -> None:
    """Build the set at `where` (under its lock); on any failure remove what was written, and say
    what stopped the build and what was removed."""
    _said.add((name, where))  # this line says where it is read
    log.info(
        "building %s in %s (%s, %s; once per machine, %s=DIR builds it elsewhere)",
        entry.what,
        where,
        entry.size,
        entry.time,
        DATA_HOME_ENV,
    )
    partial = where.with_name(where.name + ".partial")
    try:
        getattr(importlib.import_module(entry.module), entry.builder)(where)
    except BaseException as failure:
        with _no_ctrl_c():  # the builder removes it too; this is whatever it did
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(failure, KeyboardInterrupt):
            raise Interrupted(
                f"building {entry.what} in {where} was interrupted; nothing of it was kept (the next run builds "
                "it again from the start)"
            ) from None
        if isinstance(failure, OSError) and failure.errno in _CANNOT_WRITE:
            raise _not_writable(entry, where, failure, removed=True) from None
        log.error(
            "building %s in %s failed (%s: %s); what it had written (%s) was removed, and the next run builds "
            "it again from the start",
            entry.what,
            where,
            type(failure).__name__,
            failure,
            partial,
        )
        raise


_CANNOT_WRITE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}


def _not_writable(entry: EmbeddedSet, where: Path, err: OSError, removed: bool) -> OutputNotWritable:
    what_was_written = "; what it had written was removed" if removed else ""
    return OutputNotWritable(
        f"cannot build {entry.what} in {where}: {err.strerror or err}{what_was_written}. It needs {entry.size} "
        f"of free space: set {DATA_HOME_ENV} to a writable directory with room for it (each machine builds "
        "it there once)"
    )


class BuildLock:
    """A lock file (an flock, which the kernel drops when its holder dies) that its holder removes
    on release, however the build ends: no stale lock file is left to look like a build in
    progress. A process that was waiting on the file its holder removed finds another file at the
    path, or none, and locks the path anew, so two processes never both hold it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                held = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                except FileNotFoundError:
                    now = None
            except BaseException:
                os.close(fd)
                raise
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                self.fd = fd
                return
            os.close(fd)  # its holder removed that file on release: lock the one at the path now

    def release(self) -> None:
        if self.fd is None:
            return
        with _no_ctrl_c():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # while held: only the holder removes it
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def _no_ctrl_c():
    """Ctrl-C is ignored while the block runs: the cleanup after an interrupted or failed build
    (which is on its way out already), and the lock's release (microseconds) run whole."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
