"""Batches on the training device, the next one's copy overlapping the current step.

On CUDA the loader hands over batches in pinned memory (data/pipeline.py), so a copy to the GPU
can run while the GPU computes. DevicePrefetch queues batch n+1's copy on a side stream before it
hands over batch n: the copy then runs during step n, and the step never waits for it. The
compute stream waits for a batch's copy (an event) before its first use, and each copied tensor
is marked as used by the compute stream (record_stream), so that the caching allocator does not
give its memory to the side stream's next copy while the step still reads it.

Elsewhere (CPU) a batch moves synchronously as it is handed over: there is nothing to overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch with its tensors on `device` (other values as they are)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class DevicePrefetch:
    """The batches of `batches` on `device`."""

    def __init__(self, batches: Iterable[dict], device: torch.device | str):
        self.batches: Iterator[dict] = iter(batches)
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ahead: tuple[dict, torch.cuda.Event] | None = None  # the next batch, its copy queued
        self.ended = False

    def __iter__(self) -> DevicePrefetch:
        return self

    def __next__(self) -> dict:
        if self.side is None:
            return to_device(next(self.batches), self.device)
        if self.ahead is None:
            if self.ended:
                raise StopIteration
            self.ahead = self._copy(next(self.batches))  # the first: no step to overlap with
        (batch, copied), self.ahead = self.ahead, None
        try:  # the next batch's copy goes first, so that it runs while the caller computes on this one
            self.ahead = self._copy(next(self.batches))
        except StopIteration:
            self.ended = True
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(compute)
        return batch

    def _copy(self, batch: dict) -> tuple[dict, torch.cuda.Event]:
        with torch.cuda.stream(self.side):
            moved = to_device(batch, self.device)
            copied = torch.cuda.Event()
            copied.record(self.side)
        return moved, copied
