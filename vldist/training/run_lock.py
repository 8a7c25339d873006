"""One run per output directory: a second run into the same `output.dir` refuses to start.

Two runs writing checkpoints into one directory would prune and replace each other's files. Rank 0
holds a POSIX record lock (`fcntl.lockf`) on `<output.dir>/.lock` for the whole run. The kernel
drops it when the process ends, however it ends (a crash, SIGKILL), so no lock outlives its run.
Unlike `flock`, a record lock is not shared with the data-loader workers that rank 0 forks (they
could otherwise keep it after the trainer died), and NFS supports it. The file says who holds the
lock, for the refusal message; it is never read by the process that holds the lock, because
closing any descriptor of a locked file releases a POSIX lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from vldist.errors import OutputDirInUse

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise OutputDirInUse naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
    """Raise OutputDirInUse if a run holds `directory` now (the Ray driver checks before starting
    workers, so that a second job fails at once instead of in every worker)."""
    RunLock(directory).acquire().release()


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
