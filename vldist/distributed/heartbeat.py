"""What this rank is doing now: its step and phase (data, forward, backward, a named collective,
checkpoint, evaluation), and how long its last step took without waiting for the other ranks.

The training loop and the collectives set it as they go; it is a few attribute writes, no I/O.
The watchdog thread (watchdog.py) publishes it to the run's store and reads everyone's. One per
process, like torch's default process group, so that a collective deep inside a loss can say
"I am waiting in all_gather" without a handle passed down to it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

COLLECTIVE = "collective "  # phase-name prefix of a collective: waiting there is waiting for others
FORWARD = "forward"  # phase-name prefix of a forward pass


@dataclass
class StepTimes:
    """One optimizer step of this rank, in seconds."""

    step: float = 0.0  # forward, backward and update (collectives included)
    data_wait: float = 0.0  # blocked on the loader before it
    forward: float = 0.0  # of `step`, the forward passes, outside the named collectives in them

    @property
    def own(self) -> float:
        """The time this rank itself needed, not waiting for others: its forward passes outside
        collectives, and its data wait. The backward is left out: DDP's gradient all-reduce runs
        inside it, where the fast ranks wait for the slowest, so a rank's backward time says as
        much about the others as about itself. A rank slow in its own right is slow forward too."""
        return self.forward + self.data_wait


class Heartbeat:
    def __init__(self):
        self.step = 0
        self.phase = "starting"
        self.progress = 0  # counts steps and beats inside long phases (evaluation batches)
        self.last = StepTimes()
        self._window_sum, self._window_steps = StepTimes(), 0  # the steps since the watchdog last took them
        self._last_window: StepTimes | None = None
        self._forward_seconds = 0.0  # this step's, outside collectives

    @contextmanager
    def phase_of(self, name: str):
        """Inside, this rank is in phase `name`; the phase before comes back after."""
        before, self.phase = self.phase, name
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            if name.startswith(FORWARD):
                self._forward_seconds += took
            elif name.startswith(COLLECTIVE) and before.startswith(FORWARD):
                self._forward_seconds -= took  # waiting for the others inside a forward (global BatchNorm)
            self.phase = before

    def collective(self, name: str):
        return self.phase_of(COLLECTIVE + name)

    def beat(self) -> None:
        """Progress inside a long phase (an evaluation batch): the run is not hung."""
        self.progress += 1

    def step_started(self) -> None:
        self._forward_seconds = 0.0

    def step_done(self, step: int, seconds: float, data_wait: float) -> None:
        self.last = StepTimes(seconds, data_wait, max(self._forward_seconds, 0.0))
        w = self._window_sum
        self._window_sum = StepTimes(w.step + seconds, w.data_wait + data_wait, w.forward + self.last.forward)
        self._window_steps += 1
        self.step = step
        self.progress += 1

    def window_mean(self) -> StepTimes | None:
        """The mean step since the last call (the watchdog's interval), or the last such mean when
        no step completed since; None before the first step. One step says little: a rank stalled
        once is not a straggler."""
        total, n = self._window_sum, self._window_steps
        if n:
            self._last_window = StepTimes(total.step / n, total.data_wait / n, total.forward / n)
            self._window_sum, self._window_steps = StepTimes(), 0
        return self._last_window

    def beating(self, items):
        """`items`, beating once per item (evaluation batches)."""
        for item in items:
            self.beat()
            yield item


heartbeat = Heartbeat()  # this process's: see the module docstring
