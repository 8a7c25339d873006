"""No process of a run outlives it: its loader workers, their fork server and other helpers.

A run's children normally end with it: Trainer.fit closes its loaders, and an exit by exception
closes the rest at exit (data/pipeline.py's _close_open_loaders). Two exits skip all of that:

- the hang watchdog's os._exit(HUNG) (watchdog.py), taken from its thread while the main thread is
  blocked: no finally block, no atexit handler, no DataLoader shutdown runs. torch's workers look
  for their parent only between batches ("manager dead": os.getppid() changed, checked every 5 s
  while idle), so a worker inside a batch that never ends (the deadlocked loader that hung the
  run, a read from a store that never answers, a stopped process) is left running for good, with
  its memory. end_descendants() ends them first, by pid.
- a signal that ends the main process outright (SIGKILL, the kernel's OOM killer): nothing runs
  in it at all. die_with_parent(), a loader worker's first act, has the kernel send the worker
  SIGKILL when its parent goes (Linux's PR_SET_PDEATHSIG). The parent is the thread that forked
  it: the training thread that iterates the loader, or the fork server's (data/pipeline.py's
  _worker_start). The server exits when the last holder of its "alive" pipe goes, and hands that
  pipe to every process it forks: a worker that kept it would keep the server, and the server the
  worker, for ever (torch's check of a worker's parent watches the server, not the run). So a
  worker from a fork server lets go of it: the server goes with the run, and its workers with it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when the thread that forked it ends (Linux; elsewhere
    nothing: False). SIGKILL because loader workers ignore the stop signals, SIGTERM among them
    (training/stopping.py), and a wedged one handles no signal at all. A parent already gone when
    this runs ends this process now."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this libc
        return False
    if os.getppid() != parent:  # it went before the request took effect: nothing will signal
        os.kill(os.getpid(), signal.SIGKILL)
    _leave_fork_server_alive_pipe()
    return True


def _leave_fork_server_alive_pipe() -> None:
    """In a child of a fork server: close its copy of the server's "alive" pipe (see above). A
    forked copy of the run (its own server's pid known) holds the run's end, and keeps it."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None and getattr(server, "_forkserver_pid", None) is None:
        try:
            os.close(alive)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1])


def descendants(pid: int | None = None) -> dict[int, int]:
    """{pid: parent pid} of every live process below `pid` (default: this one), from /proc's parent
    links (zombies left out: they have ended). Empty where there is no /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for child in children.get(parent, ()):
            if child not in found:
                found[child] = parent
                todo.append(child)
    return found


def _multiprocessing_children() -> dict[int, int]:
    """Without /proc: multiprocessing's children of this process and the fork server, if started."""
    found = {p.pid: os.getpid() for p in multiprocessing.active_children() if p.pid}
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if getattr(server, "_forkserver_pid", None):
        found[server._forkserver_pid] = os.getpid()
    return found


def end_descendants(grace_s: float = 5.0) -> list[int]:
    """SIGKILL every process below this one, found by pid, and wait up to `grace_s` for them to end;
    returns the pids signalled. For an exit that skips every cleanup (watchdog.py's os._exit).

    SIGKILL: loader workers ignore SIGTERM (a stop signal), a wedged worker acts on no other, and
    the run is being given up. multiprocessing's resource tracker is spared: it ends by itself
    once every process holding its pipe has, and removes what they left in /dev/shm. Never raises."""
    try:
        tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
        spared = {getattr(tracker, "_pid", None)}
        signalled: dict[int, int | None] = {}
        for _ in range(3):  # again for any started meanwhile (the main thread may be starting workers)
            found = descendants() if os.path.isdir("/proc") else _multiprocessing_children()
            found = {pid: parent for pid, parent in found.items() if pid not in spared and pid not in signalled}
            if not found:
                break
            # every one held (by a pidfd) before any is signalled: once a fork server is gone, its
            # workers are another process's children, which the check of their parent would take
            # for pids reused since the scan
            held = {pid: _hold(pid, parent) for pid, parent in found.items()}
            signalled.update({pid: fd for pid, (ours, fd) in held.items() if ours and _kill(pid, fd)})
            for pid, (_, fd) in held.items():
                if fd is not None and pid not in signalled:
                    os.close(fd)
        _wait_gone(signalled, grace_s)
        for fd in signalled.values():
            if fd is not None:
                os.close(fd)
        return sorted(signalled)
    except Exception:  # noqa: BLE001 - the exit it precedes must happen whatever this meets
        return []


def _hold(pid: int, parent: int) -> tuple[bool, int | None]:
    """(whether it is still `parent`'s child: not gone, its pid not reused since the scan; a pidfd
    of it, or None where pidfds are missing)."""
    fd = None
    if hasattr(os, "pidfd_open"):  # Linux >= 5.3: a signal through it reaches this process, whatever reuses its pid
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = None
    stat = _stat(pid)
    return not (os.path.isdir("/proc") and (stat is None or stat[1] != parent)), fd


def _kill(pid: int, fd: int | None) -> bool:
    try:
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:  # ended meanwhile
        return False
    return True


def _wait_gone(held: dict[int, int | None], grace_s: float) -> None:
    """Until every process has ended (its pidfd turns readable; without one, /proc or waitpid says)."""
    deadline = time.monotonic() + grace_s
    left = dict(held)
    while left:
        for pid, fd in list(left.items()):
            if _ended(pid) if fd is None else _readable(fd):
                del left[pid]
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _readable(fd: int) -> bool:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


def _ended(pid: int) -> bool:
    stat = _stat(pid)
    if stat is not None:
        return stat[0] == "Z"
    if os.path.isdir("/proc"):
        return True
    try:  # no /proc: a child of this process is reaped here, another process is probed
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        return False
