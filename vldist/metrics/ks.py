"""The cut-offs K of recall@K metrics, checked once for all of them."""

from __future__ import annotations

import numpy as np


def check_ks(ks) -> tuple:
    """`ks` as a tuple of positive ints; ValueError naming the bad value otherwise."""
    ks = tuple(ks)
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1]
    if not ks or bad:
        raise ValueError(f"ks must be a non-empty sequence of positive ints, got {ks!r}")
    return ks
