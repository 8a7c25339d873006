"""Profiles on demand (`train.profile_steps=A:B`): steps A to B recorded with torch.profiler.

Each rank writes `<output.dir>/profile/rank<R>-steps-A-B.json`, a Chrome trace that Perfetto
(ui.perfetto.dev) and TensorBoard's profile plugin open; each step in it is a range named
`step N`. On CUDA the rank also writes a memory snapshot of the window
(`rank<R>-steps-A-B-memory.pickle`, for pytorch.org/memory_viz). Rank 0 prints the window's top
operators by self time, so that where a step goes shows without opening the trace.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from vldist.config import profile_window

log = logging.getLogger("vldist.train")

TOP_OPERATORS = 10
MEMORY_EVENTS = 100_000  # the allocations a CUDA snapshot keeps: enough for a few steps of a large model


class StepProfiler:
    """Started before step A and stopped after step B by the loop; a no-op outside the window (and
    when train.profile_steps is unset)."""

    def __init__(self, window: str | None, directory: Path, device: torch.device, rank: int, is_main: bool):
        self.first, self.last = profile_window(window) if window else (0, -1)
        self.directory, self.device, self.rank, self.is_main = directory, device, rank, is_main
        self.profile: profile | None = None

    def step(self, step: int):
        """The context of step `step` (1-based): it starts the recording at the window's first step
        and names the step in the trace."""
        if not self.first <= step <= self.last:
            return nullcontext()
        if self.profile is None:
            self._start()
        return record_function(f"step {step}")

    def step_done(self, step: int) -> None:
        if self.profile is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """End the recording (the run may end or stop inside the window): write and report it."""
        if self.profile is None:
            return
        recorded, self.profile = self.profile, None
        recorded.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}-steps-{self.first}-{self.last}"
        trace = self.directory / f"{name}.json"
        recorded.export_chrome_trace(str(trace))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.directory / f"{name}-memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.is_main:
            log.info("%s\ntrace: %s (open in ui.perfetto.dev)", top_operators(recorded, self.device), trace)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        self.profile = profile(activities=activities, record_shapes=True, with_stack=True, profile_memory=True)
        self.profile.__enter__()


def top_operators(recorded: profile, device: torch.device, limit: int = TOP_OPERATORS) -> str:
    """The operators that took the most self time in the window, with their share and calls."""
    on_device = device.type == "cuda"
    events = [e for e in recorded.key_averages() if not e.key.startswith("step ")]
    times = {e.key: _self_time(e, on_device) for e in events}
    total = sum(times.values()) or 1
    rows = sorted(events, key=lambda e: times[e.key], reverse=True)[:limit]
    lines = [
        f"profile: top operators by self {'device' if on_device else 'CPU'} time",
        f"{'operator':<44} {'ms':>10} {'share':>7} {'calls':>7}",
    ]
    lines += [f"{e.key[:44]:<44} {times[e.key] / 1e3:>10.2f} {times[e.key] / total:>7.1%} {e.count:>7}" for e in rows]
    return "\n".join(lines)


def _self_time(event, on_device: bool) -> float:
    """Microseconds of the operator's own time, on the device or on the CPU."""
    if not on_device:
        return event.self_cpu_time_total
    # torch < 2.4 names it self_cuda_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
