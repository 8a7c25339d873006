"""One run per output directory: a second run into the same `output.dir` refuses to start.

Two runs writing checkpoints into one directory would prune and replace each other's files. Rank 0
holds a POSIX record lock (`fcntl.lockf`) on `<output.dir>/.lock` for the whole run. The kernel
drops it when the process ends, however it ends (a crash, SIGKILL), so no lock outlives its run.
Unlike `flock`, a record lock is not shared with the data-loader workers that rank 0 forks (they
could otherwise keep it after the trainer died), and NFS supports it. The file says who holds the
lock, for the refusal message; it is never read by the process that holds the lock, because
closing any descriptor of a locked file releases a POSIX lock.

`check_writable` refuses a directory a command cannot write (a read-only filesystem, a file in the
way) before anything starts, in one line that names the path and the cause.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from vldist.errors import OutputDirInUse, OutputNotWritable

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise OutputDirInUse naming the run that holds it (OutputNotWritable:
        the directory cannot be made or written)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # the Ray driver's check_free meets it here first
            raise OutputNotWritable(not_writable("output.dir", self.path.parent, err)) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read(fd)
            os.close(fd)
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise OutputDirInUse(
                    f"cannot lock {self.path} ({err}); is output.dir on a filesystem without locks?"
                ) from err
            raise OutputDirInUse(_in_use_message(self.path.parent, holder)) from None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_free(directory: Path) -> None:
    """Raise OutputDirInUse if a run holds `directory` now, OutputNotWritable if it cannot be
    written (the Ray driver checks before starting workers, so that a second job fails at once
    instead of in every worker)."""
    RunLock(directory).acquire().release()


def check_writable(directory: Path, key: str, shown: str | None = None, make: bool = True) -> None:
    """Make `directory` (and its parents) and create and remove a file in it, or raise
    OutputNotWritable naming `key` (output.dir, --out, ...), the path (`shown`, else the directory)
    and the cause. `make=False`: make nothing, probe the nearest directory that exists instead (a
    command that may still refuse for another reason leaves no directories behind)."""
    directory = Path(directory)
    try:
        if make:
            directory.mkdir(parents=True, exist_ok=True)
        probed = directory if make else next(p for p in (directory, *directory.parents) if os.path.lexists(p))
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=probed)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OutputNotWritable(not_writable(key, directory, err, shown)) from None


def not_writable(key: str, directory: Path, err: OSError, shown: str | None = None) -> str:
    """`cannot write to output.dir /x: Read-only file system. Choose another output.dir=DIR or make it writable`."""
    directory = Path(directory)
    value = "URL" if shown and "://" in shown else "DIR"
    choose = f"{key} {value}" if key.startswith("-") else f"{key}={value}"
    cause, fix = err.strerror or str(err), "or make it writable"
    if isinstance(err, (NotADirectoryError, FileExistsError)):
        # mkdir names the directory it could not make, not the file in the way: name that file
        blocking = next((p for p in (directory, *directory.parents) if os.path.lexists(p)), None)
        if blocking is not None and not blocking.is_dir():
            what = "a file, not a directory" if blocking.is_file() else "not a directory"  # a broken link, a device
            cause, fix = f"{blocking} is {what}", f"or move {blocking} out of the way"
    return f"cannot write to {key} {shown or directory}: {cause}. Choose another {choose} {fix}"


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 64 * 1024, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _in_use_message(directory: Path, holder: dict) -> str:
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if "started" in holder:
        who += f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}"
    command = " ".join(holder.get("command") or [])
    return (
        f"output.dir {directory} is in use by another run: {who}" + (f" ({command})" if command else "") + ". "
        "Wait for it to finish, stop it (SIGTERM makes it checkpoint and exit), or set another output.dir."
    )
