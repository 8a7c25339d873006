"""Counting and rate-limited reporting of corrupt samples, and shards a store could not serve, that
the pipeline skips.

Each loader worker is its own process, so each has its own counter; the pipeline attaches the
number skipped since the last batch to every batch (`batch["skipped"]`, with the first reasons in
`batch["skip_reasons"]`), and the trainer and the evaluation sum them.
"""

from __future__ import annotations

import logging
import time

from vldist.errors import StoreLost
from vldist.store.retry import ShardUnavailable

log = logging.getLogger("vldist.data")


class SkipCounter:
    """A webdataset error handler: counts the failure, warns at a bounded rate, continues."""

    def __init__(self, first_warnings: int = 5, then_every_seconds: float = 30.0, reasons_kept: int = 3):
        self.total = 0
        self.pending = 0  # skipped since the last take()
        self.reasons: list[str] = []  # the first few since the last take(), to explain an empty split
        self.reasons_kept = reasons_kept
        self.first_warnings = first_warnings
        self.then_every_seconds = then_every_seconds
        self._last_warning = 0.0
        self._suppressed = 0

    def __call__(self, exn: BaseException) -> bool:
        if isinstance(exn, StoreLost):  # not a sample's fault: the run ends (webdataset re-raises nothing itself)
            raise exn
        self.total += 1
        self.pending += 1
        if len(self.reasons) < self.reasons_kept:
            self.reasons.append(f"{type(exn).__name__}: {exn}")
        now = time.monotonic()
        if self.total <= self.first_warnings or now - self._last_warning >= self.then_every_seconds:
            extra = f" ({self._suppressed} more not shown)" if self._suppressed else ""
            if isinstance(exn, ShardUnavailable):  # its own message, without the stream WebDataset appends
                what, reason = "an unreadable shard", exn.args[0]
            else:
                what, reason = "corrupt sample", exn
            log.warning("skipping %s #%d: %s: %s%s", what, self.total, type(exn).__name__, reason, extra)
            self._last_warning = now
            self._suppressed = 0
        else:
            self._suppressed += 1
        return True  # tell webdataset to continue with the next sample

    def take(self) -> tuple[int, list[str]]:
        """(samples skipped since the last take, the first reasons among them)."""
        n, reasons, self.pending, self.reasons = self.pending, self.reasons, 0, []
        return n, reasons


# One per process: the loader workers each get their own copy when they start.
skipped = SkipCounter()
