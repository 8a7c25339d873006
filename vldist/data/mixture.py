"""How weighted sources (data.sources) share a stream's positions: which source each position
draws from, and how many of a source's samples come before it, both in constant time.

The weights are rounded to whole shares of PERIOD positions, and one period's pattern is laid out
once by always giving the next position to the source furthest behind its share (ties to the first
source): every run of positions then holds each source within one sample of its proportion, and
every whole period exactly its share. Position q draws from pattern[q mod PERIOD], and is that
source's (q // PERIOD) * share + (its positions before q mod PERIOD in the pattern)-th sample.
open_clip's upsampling factors and mosaicml/streaming's proportions choose the same mix over an
epoch; here it also holds within every global batch, and a resumed run finds its place without
counting the batches before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERIOD = 10_000  # weights are kept to 1/PERIOD


class Mixture:
    def __init__(self, weights: Sequence[float]):
        weights = np.asarray(weights, dtype=np.float64)
        if len(weights) == 0 or not (weights > 0).all():
            raise ValueError(f"source weights must be positive, got {list(weights)}")
        exact = weights / weights.sum() * PERIOD
        shares = np.floor(exact).astype(np.int64)
        # the positions rounding left over go to the largest remainders
        for i in np.argsort(-(exact - shares), kind="stable")[: PERIOD - shares.sum()]:
            shares[i] += 1
        if not (shares > 0).all():
            raise ValueError(f"a source weight below 1/{PERIOD} of the total draws nothing: {list(weights)}")
        self.shares = shares
        self.pattern = np.empty(PERIOD, dtype=np.int64)
        taken = np.zeros(len(shares), dtype=np.int64)
        for q in range(PERIOD if len(shares) > 1 else 0):
            source = int(np.argmax((q + 1) * shares - taken * PERIOD))
            self.pattern[q] = source
            taken[source] += 1
        if len(shares) == 1:
            self.pattern[:] = 0
        # before[i, j]: source i's positions among pattern[:j]
        self.before = np.zeros((len(shares), PERIOD + 1), dtype=np.int64)
        for i in range(len(shares)):
            self.before[i, 1:] = np.cumsum(self.pattern == i)

    @property
    def sources(self) -> int:
        return len(self.shares)

    def taken(self, position: int) -> np.ndarray:
        """Each source's samples among positions [0, position)."""
        whole, rest = divmod(position, PERIOD)
        return whole * self.shares + self.before[:, rest]

    def draws(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, that source's position) of positions [start, stop)."""
        taken = self.taken(start)
        out = []
        for q in range(start, stop):
            source = int(self.pattern[q % PERIOD])
            out.append((source, int(taken[source])))
            taken[source] += 1
        return out
