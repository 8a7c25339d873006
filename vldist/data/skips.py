"""Counting and rate-limited reporting of corrupt samples, and shards a store could not serve, that
the pipeline skips.

Each loader worker is its own process, so each has its own counter; the pipeline attaches the
number skipped since the last batch to every batch (`batch["skipped"]`, with the first reasons in
`batch["skip_reasons"]` and the count of each shard they came from in `batch["skipped_by_shard"]`),
and the trainer and the evaluation sum them.

A sample is counted each time a stream would have read it and could not: a shard cut short counts
the samples its manifest lists beyond the cut (MissingSamples), once per reading of the shard.
"""

from __future__ import annotations

import logging
import time

from vldist.errors import StoreLost
from vldist.store.location import redact
from vldist.store.retry import ShardUnavailable

log = logging.getLogger("vldist.data")


class MissingSamples(ValueError):
    """A shard held fewer samples than its manifest lists: `samples` of them could not be read (a
    tar cut short, a member that cannot be read); the message names the shard and where it broke."""

    def __init__(self, message: str, samples: int, shard: str | None = None):
        super().__init__(message)
        self.samples, self.shard = samples, shard


def shard_of(exn: BaseException) -> str | None:
    """The shard a skip came from, where the error says it (MissingSamples, or a `shard` the pipeline set)."""
    return getattr(exn, "shard", None)


class SkipCounter:
    """A webdataset error handler: counts the failure, warns at a bounded rate, continues."""

    def __init__(self, first_warnings: int = 5, then_every_seconds: float = 30.0, reasons_kept: int = 3):
        self.total = 0
        self.pending = 0  # skipped since the last take()
        self.reasons: list[str] = []  # the first few since the last take(), to explain an empty split
        self.by_shard: dict[str, int] = {}  # skipped since the last take(), by shard (where known)
        self.reasons_kept = reasons_kept
        self.first_warnings = first_warnings
        self.then_every_seconds = then_every_seconds
        self._warnings = 0
        self._last_warning = 0.0
        self._suppressed = 0

    def __call__(self, exn: BaseException, shard: str | None = None) -> bool:
        """Count `exn` (MissingSamples: its samples; else one sample) against `shard`; True: go on."""
        if isinstance(exn, StoreLost):  # not a sample's fault: the run ends (webdataset re-raises nothing itself)
            raise exn
        count = exn.samples if isinstance(exn, MissingSamples) else 1
        shard = shard or shard_of(exn)
        self.total += count
        self.pending += count
        if shard is not None:
            shard = redact(shard)
            self.by_shard[shard] = self.by_shard.get(shard, 0) + count
        if len(self.reasons) < self.reasons_kept:
            self.reasons.append(f"{type(exn).__name__}: {exn}")
        now = time.monotonic()
        if self._warnings < self.first_warnings or now - self._last_warning >= self.then_every_seconds:
            extra = f" ({self._suppressed} more not shown)" if self._suppressed else ""
            if isinstance(exn, ShardUnavailable):  # its own message, without the stream WebDataset appends
                what, reason = "an unreadable shard", f"{type(exn).__name__}: {exn.args[0]}"
            elif isinstance(exn, MissingSamples):
                what, reason = f"{count} samples of a damaged shard", str(exn)
            else:
                what, reason = "corrupt sample", f"{type(exn).__name__}: {exn}"
            log.warning("skipping %s #%d: %s%s", what, self.total, reason, extra)  # #n: the count so far
            self._warnings += 1
            self._last_warning = now
            self._suppressed = 0
        else:
            self._suppressed += 1
        return True  # tell webdataset to continue with the next sample

    def take(self) -> tuple[int, list[str], dict[str, int]]:
        """(samples skipped since the last take, the first reasons among them, their count by shard)."""
        taken = self.pending, self.reasons, self.by_shard
        self.pending, self.reasons, self.by_shard = 0, [], {}
        return taken


# One per process: the loader workers each get their own copy when they start.
skipped = SkipCounter()
