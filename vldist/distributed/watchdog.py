"""A thread in every rank that names a hung run and a straggling rank instead of waiting them out.

Each interval it publishes this rank's heartbeat (heartbeat.py: step, phase, own step time) to the
run's store under `vldist/heartbeat/`, and adds the rank's new progress (steps, evaluation
batches) to one counter there. Then:

- Hang: when that counter, the whole run's progress, has not moved for `train.hang_timeout_s`,
  every live rank prints which ranks stopped (host, rank, pid, step, phase), its own Python stack
  (faulthandler), and exits HUNG (3): the launcher restarts the job, and train.resume=auto carries
  on from the newest checkpoint. A rank whose heartbeat stopped too (frozen, or its node gone) is
  named as the cause; else a rank outside any collective (stuck in its own code); else the ranks
  at the lowest step.
- Straggler (rank 0): when the slowest rank's own step time (compute and data wait, not the time
  spent waiting in collectives for the others) is `train.straggler_ratio` times the median of the
  others', the progress line names it, and a warning says so at most once a minute.

The thread talks to the store through a client of its own with a short timeout, so a store whose
host is frozen delays it, never blocks it (torch's own client waits `engine.timeout_s`).
torch.distributed's own timeout (`engine.timeout_s`) stays the last resort.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta

from vldist.distributed.heartbeat import COLLECTIVE, Heartbeat
from vldist.distributed.orphans import end_descendants
from vldist.exit_codes import HUNG  # a rank that gave up on a hung run (docs/observability.md)

log = logging.getLogger("vldist.train")

PREFIX = "vldist/heartbeat/"
PROGRESS_KEY = PREFIX + "progress"
WARN_EVERY_S = 60.0  # straggler warnings, at most one per rank per this many seconds


def watchdog_store(timeout_s: float):
    """A client of its own to the run's TCPStore (the default process group's), or None when
    there is no process group or its store is not a TCPStore (then the watchdog watches this
    rank alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore around the TCPStore
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    try:
        return dist.TCPStore(
            store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except Exception as err:  # noqa: BLE001 - watching this rank alone beats not training
        log.warning(
            "the watchdog cannot reach the run's store at %s:%d (%s); it watches this rank alone",
            store.host,
            store.port,
            err,
        )
        return None


class Watchdog:
    def __init__(
        self,
        heartbeat: Heartbeat,
        store,
        rank: int,
        world_size: int,
        hang_timeout_s: float,
        straggler_ratio: float | None,
        resume_hint: str,
        on_hang=None,
    ):
        """store: watchdog_store()'s, or None (this rank alone); on_hang(message): what a hang
        does after the report (default: exit HUNG at once, whatever the main thread is in)."""
        self.heartbeat, self.store, self.rank, self.world_size = heartbeat, store, rank, world_size
        self.hang_timeout_s, self.straggler_ratio, self.resume_hint = hang_timeout_s, straggler_ratio, resume_hint
        self.interval = self.interval_for(hang_timeout_s)
        self.on_hang = on_hang or _exit_hung
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.straggler: str | None = None  # the progress line's note, set on rank 0
        self._seq, self._published_progress = 0, 0
        self._last_warning: dict[int, float] = {}  # by the rank named
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vldist-watchdog", daemon=True)

    @staticmethod
    def interval_for(hang_timeout_s: float) -> float:
        """How often heartbeats go out: often enough to notice a hang well inside its timeout."""
        return min(5.0, max(hang_timeout_s / 10, 0.2)) if hang_timeout_s else 5.0

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it, then let go of the store client. The thread is a daemon
        (a hang report must not keep a process alive), and a daemon thread still inside a store
        call (C++, without the GIL) when the interpreter shuts down is killed as it takes the GIL
        back, which aborts the process ("terminate called without an active exception"): so
        stop() waits out a store call in flight, which its client's timeout bounds."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 3 * self._store_timeout_s() + 5)
        if self._thread.is_alive():
            log.warning("the watchdog thread did not stop (its store does not answer); it is left to the exit")
            return
        self.store = None  # this rank's client of the store: closed now, not in the interpreter's teardown

    def _store_timeout_s(self) -> float:
        """How long one call to the store can block (the client's own timeout)."""
        timeout = getattr(self.store, "timeout", None)
        return timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        last_total, last_change = None, time.monotonic()
        while not self._stopping.wait(self.interval):
            try:
                self._publish()
                total = self._progress_total()
            except Exception:  # noqa: BLE001 - a store that does not answer is no progress
                total = last_total
            if self._stopping.is_set():  # stop() waits for the thread: no further store call
                return
            now = time.monotonic()
            if total != last_total:
                last_total, last_change = total, now
            elif self.hang_timeout_s and now - last_change >= self.hang_timeout_s:
                self.on_hang(self._hang_report(now - last_change))
                return
            if self.rank == 0 and self.straggler_ratio and self.store is not None:
                try:
                    self._check_stragglers(self._records())
                except Exception:  # noqa: BLE001 - the check is advice; the next interval tries again
                    pass

    def _record(self, reporting: bool = False) -> dict:
        hb, times = self.heartbeat, self.heartbeat.window_mean()
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "step": hb.step,
            "phase": hb.phase,
            "seq": self._seq,
            "own": times.own if times else None,
            "data_wait": times.data_wait if times else None,
            "reporting": reporting,
        }

    def _publish(self, reporting: bool = False) -> None:
        self._seq += 1
        if self.store is None:
            return
        self.store.set(f"{PREFIX}rank/{self.rank}", json.dumps(self._record(reporting)))
        progress = self.heartbeat.progress
        if progress != self._published_progress:
            self.store.add(PROGRESS_KEY, progress - self._published_progress)
            self._published_progress = progress

    def _progress_total(self) -> int:
        return self.heartbeat.progress if self.store is None else self.store.add(PROGRESS_KEY, 0)

    def _records(self) -> dict[int, dict]:
        records = {}
        for rank in range(self.world_size):
            key = f"{PREFIX}rank/{rank}"
            if self.store.check([key]):
                records[rank] = json.loads(self.store.get(key))
        return records

    # ------------------------------------------------------------------ hangs

    def _hang_report(self, stalled_s: float) -> str:
        head = (
            f"error: no rank of the run advanced for {stalled_s:.0f} s (train.hang_timeout_s={self.hang_timeout_s:g}): "
        )
        tail = (
            f" Rank {self.rank} on {self.host} exits {HUNG} so that the launcher restarts the job; "
            f"{self.resume_hint} Its stack follows."
        )
        if self.store is None:
            hb = self.heartbeat
            return head + f"rank {self.rank} on {self.host} (pid {self.pid}) is in {hb.phase} at step {hb.step}." + tail
        try:
            self._publish(reporting=True)
            before = self._records()
            time.sleep(2 * self.interval)  # a live rank's heartbeat moves in that time; a frozen one's does not
            self._publish(reporting=True)
            after = self._records()
        except Exception as err:  # noqa: BLE001
            return (
                head
                + (
                    f"the run's store does not answer ({err}); the process hosting it (rank 0, or the "
                    "launcher's agent on the first node) is stopped or gone."
                )
                + tail
            )
        return head + describe_hang(before, after, self.world_size) + tail

    # ------------------------------------------------------------------ stragglers

    def _check_stragglers(self, records: dict[int, dict]) -> None:
        found = find_straggler(records, self.straggler_ratio)
        self.straggler = found[1] if found else None
        now = time.monotonic()
        if found and now - self._last_warning.get(found[0], -WARN_EVERY_S) >= WARN_EVERY_S:
            self._last_warning[found[0]] = now
            log.warning(
                "straggler: %s (train.straggler_ratio=%g; docs/observability.md)", found[1], self.straggler_ratio
            )


def _who(r: dict) -> str:
    return f"rank {r['rank']} on {r['host']} (pid {r['pid']})"


def describe_hang(before: dict[int, dict], after: dict[int, dict], world_size: int) -> str:
    """Which ranks stopped, from two reads of the heartbeats some intervals apart."""
    missing = [rank for rank in range(world_size) if rank not in after]
    frozen = [
        after[r] for r in sorted(after) if not after[r]["reporting"] and before.get(r, {}).get("seq") == after[r]["seq"]
    ]
    alive = [after[r] for r in sorted(after) if after[r] not in frozen]
    if frozen:
        culprits = frozen
        said = "; ".join(f"{_who(r)} stopped responding, last at step {r['step']} in {r['phase']}" for r in frozen)
    else:
        own_code = [r for r in alive if not r["phase"].startswith(COLLECTIVE)]
        low = min((r["step"] for r in alive), default=0)
        culprits = own_code or [r for r in alive if r["step"] == low]
        said = "; ".join(f"{_who(r)} is stuck at step {r['step']} in {r['phase']}" for r in culprits)
    others = [r for r in alive if r not in culprits]
    if others:
        said += "; waiting for it: " + ", ".join(f"{_who(r)} at step {r['step']} in {r['phase']}" for r in others)
    if missing:
        said += f"; never reported: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    return said + "."


def find_straggler(records: dict[int, dict], ratio: float) -> tuple[int, str] | None:
    """(1, 'rank 1 on node1 takes 2.4x the other ranks' median step (0.52 s against 0.22 s, 0.01 s of
    it data wait)'), or None when no rank runs `ratio` times behind the others."""
    timed = [r for r in records.values() if r.get("own")]
    if len(timed) < 2:
        return None
    slowest = max(timed, key=lambda r: r["own"])
    median = statistics.median(r["own"] for r in timed if r is not slowest)
    if median <= 0 or slowest["own"] < ratio * median:
        return None
    return slowest["rank"], (
        f"rank {slowest['rank']} on {slowest['host']} takes {slowest['own'] / median:.1f}x the other ranks' "
        f"median step ({slowest['own']:.2f} s against {median:.2f} s, {slowest['data_wait']:.2f} s of it data wait)"
    )


def _exit_hung(message: str) -> None:
    """Say it, show where this rank is, and leave now: the main thread is blocked in a collective
    that no exception can reach. os._exit skips every cleanup (the loaders' shutdown, atexit), and
    a loader worker inside a batch that never ends would outlive the run: this rank's processes
    (loader workers, their fork server, helpers) are ended first (orphans.py)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    end_descendants()
    os._exit(HUNG)
