"""Stop requests: a signal makes training finish its step, checkpoint and exit, instead of dying.

Schedulers ask a job to stop with a signal some time before they kill it:
- Slurm: SIGTERM on preemption and `scancel`; the time-limit warning `--signal=B:USR1@<s>`, which
  `cluster/slurm/train.sbatch` forwards to the ranks and answers with a requeue;
- torchrun: relays the signal it gets to each rank's process group;
- Kubernetes: SIGTERM to the container's first process;
- `ray job stop`: SIGTERM to the driver, which relays the request through its run board, an actor
  the workers ask (Ray Train workers are actors: no signal reaches them, see launch/run_board.py).

A handler only records the request. The trainer reads it once per optimizer step, and the ranks
agree through the all-reduce every step already makes (a signal may reach one rank only), so all
stop after the same step, write one checkpoint together and exit with exit_codes.STOPPED (75). Later signals
are acknowledged and ignored: the checkpoint being written completes (and were the process killed
anyway, the atomic write leaves the previous checkpoint intact).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager


def signal_numbers(names) -> list[signal.Signals]:
    """['SIGTERM', 'USR1'] -> [Signals.SIGTERM, Signals.SIGUSR1]; unknown names raise ValueError."""
    out = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        try:
            out.append(signal.Signals[key])
        except KeyError:
            raise ValueError(f"'{name}' is not a signal name (e.g. SIGTERM, SIGUSR1)") from None
    return out


class StopRequest:
    """Whether a stop was asked for, and by what: a signal to this process, or `watch`, a function
    that returns the reason of a request made elsewhere, or None (a Ray worker asks its driver's
    board: launch/run_board.py)."""

    def __init__(self, watch: Callable[[], str | None] | None = None):
        self.reason: str | None = None
        self.signals: tuple[signal.Signals, ...] = ()
        self.watch = watch
        self._pid = os.getpid()
        self._next_look = 0.0

    @property
    def requested(self) -> bool:
        if self.reason is None and self.watch is not None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + 1.0  # one look a second, not one a step
            self.reason = self.watch()
        return self.reason is not None

    def handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return  # a data-loader worker forked from the trainer: the trainer decides, workers go on
        name = signal.Signals(signum).name
        # os.write, not logging: a handler may interrupt a logging call in progress
        if self.reason is None:
            self.reason = name
            os.write(2, f"vldist: {name} received: finishing this step, then checkpointing and stopping\n".encode())
        else:
            os.write(2, f"vldist: {name} received again: already stopping, the checkpoint is being written\n".encode())


@contextmanager
def stop_requests(signal_names=(), watch=None):
    """A StopRequest fed by the named signals while the block runs; the previous handlers come back
    afterwards, unless a stop was requested: then the process is on its way out, and the signals
    stay ignored (when one rank exits first, torchrun and srun signal the others, which must not
    die with -15 instead of their own exit code). Handlers can only be set in the main thread:
    elsewhere (a Ray Train worker runs the training function in a thread) only `watch` counts
    (StopRequest)."""
    global _interrupted
    _interrupted = False  # a new run (several run in one process under tests and stages)
    stop = StopRequest(watch)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        stop.signals = tuple(signal_numbers(signal_names))
        previous = {sig: signal.signal(sig, stop.handle) for sig in stop.signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if stop.reason else handler)


@contextmanager
def interrupts_deferred():
    """Ctrl-C inside the block takes effect as a KeyboardInterrupt when the block ends. For data-loader
    calls, which are not safe to interrupt: a KeyboardInterrupt inside an iterator's __del__ (its
    workers shutting down) is printed as 'Exception ignored' and lost, so training went on; one in
    the middle of receiving a batch's shared memory left the sending worker to print a traceback.
    Does nothing where SIGINT is not Python's default (a stop signal, or a thread other than main)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    global _interrupted
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        _interrupted = True  # should this raise land in a finalizer, the next check raises it again
        raise KeyboardInterrupt


_interrupted = False


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that interrupts_deferred took, in case it was raised
    where Python drops exceptions (a generator closed by the garbage collector): the trainer calls
    this between steps and after evaluation, so Ctrl-C always ends the run."""
    if _interrupted:
        raise KeyboardInterrupt


def ignore_in_worker(signals, worker_id: int | None = None) -> None:
    """worker_init_fn of data loaders: a stop signal sent to the whole process group (torchrun,
    Slurm) must not kill the loader workers mid-epoch; the trainer stops them when it is done."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
