"""The order of an epoch's samples over indexed shards, computed from the seed and the epoch alone,
so that any rank and worker finds the samples at any position without reading what comes before.

A sample is (shard, row): its shard's number in the split and its row in that shard's index.

- ExactOrder: every sample once. The shards are permuted, their samples laid end to end in that
  order, and the samples permuted within consecutive windows of `window` positions (the shuffle
  buffer's size). A window touches one shard or a few, so the reads of a batch stay close together
  (the alternative, one permutation of the whole epoch, spreads every batch over every shard:
  bench/exact_data.py measures both).
- ResampledOrder: one rank's endless draws. Window w is drawn with a generator of its own,
  seeded by (seed, epoch, rank, w): whole shards drawn with replacement until they hold `window`
  samples, those samples permuted and the window filled from them. Each rank reads only the
  shards it draws, as WebDataset's resampled shards, and position p is found without drawing any
  window before it.

Both are counter-based (one generator per window, seeded by its number), which is what makes a
resume at any position cost nothing: mosaicml/streaming orders its epochs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _generator(*parts: int) -> np.random.Generator:
    return np.random.default_rng([p & 0xFFFF_FFFF for p in parts] + [p >> 32 for p in parts])


class _Windows:
    """Positions in consecutive windows, each built once and kept while it is in use."""

    def __init__(self, window: int):
        self.window = max(1, window)
        self._built: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _cached(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        if w not in self._built:
            if len(self._built) >= 4:  # a batch spans two windows at most; older ones are done with
                self._built.pop(next(iter(self._built)))
            self._built[w] = self._window(w)
        return self._built[w]

    def sample(self, position: int) -> tuple[int, int]:
        """The (shard, row) at `position`."""
        w, offset = divmod(position, self.window)
        shards, rows = self._cached(w)
        return int(shards[offset]), int(rows[offset])

    def samples(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The (shard, row) of positions [start, stop)."""
        out: list[tuple[int, int]] = []
        position = start
        while position < stop:
            w, offset = divmod(position, self.window)
            shards, rows = self._cached(w)
            take = min(stop - position, len(shards) - offset)
            out.extend(zip(shards[offset : offset + take].tolist(), rows[offset : offset + take].tolist(), strict=True))
            position += take
        return out


class ExactOrder(_Windows):
    """Every sample of the shards once, in the epoch's order (see the module's docstring)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, window: int, round_: int = 0):
        """`round_`: another order of the same epoch, for a source read more than once in it."""
        super().__init__(window)
        self.shuffled = window > 1
        self.seed, self.epoch, self.round = seed, epoch, round_
        self.order = _generator(seed, epoch, round_).permutation(len(counts))  # the shards, in this epoch's order
        in_order = np.asarray(counts, dtype=np.int64)[self.order]
        self.ends = np.cumsum(in_order)  # where each shard's samples end, laid end to end
        self.starts = self.ends - in_order
        self.size = int(self.ends[-1]) if len(self.ends) else 0

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(w * self.window, min(self.size, (w + 1) * self.window), dtype=np.int64)
        if self.shuffled:
            positions = _generator(self.seed, self.epoch, self.round, w, 1).permutation(positions)
        slot = np.searchsorted(self.ends, positions, side="right")
        return self.order[slot], positions - self.starts[slot]


class ResampledOrder(_Windows):
    """One rank's endless draws of samples (see the module's docstring)."""

    def __init__(self, counts: Sequence[int], seed: int, epoch: int, rank: int, window: int):
        self.counts = np.asarray(counts, dtype=np.int64)
        if not (self.counts > 0).any():
            raise ValueError("no shard holds a sample")
        self.shuffled = window > 1
        # without shuffling, a window is as long as the longest shard, in its stored order
        super().__init__(window if self.shuffled else int(self.counts.max()))
        self.seed, self.epoch, self.rank = seed, epoch, rank

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        rng = _generator(self.seed, self.epoch, self.rank, w)
        shards, held = [], 0
        while held < self.window:
            shard = int(rng.integers(len(self.counts)))
            shards.append(shard)
            held += int(self.counts[shard])
        which = np.concatenate([np.full(self.counts[s], s, dtype=np.int64) for s in shards])
        rows = np.concatenate([np.arange(self.counts[s], dtype=np.int64) for s in shards])
        if self.shuffled:
            keep = rng.permutation(len(which))[: self.window]
            return which[keep], rows[keep]
        return which[: self.window], rows[: self.window]


def rank_rows(size: int, world: int, rank: int) -> range:
    """Rank `rank`'s rows of a global batch of `size` rows: equal shares (a partial last batch dealt
    as evenly as possible, the first ranks taking one row more)."""
    share, extra = divmod(size, world)
    start = rank * share + min(rank, extra)
    return range(start, start + share + (rank < extra))
