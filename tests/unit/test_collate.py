"""The collate helpers (data/collate.py) build the same float32 rows from float16 and float32
features as numpy's conversion does, and padding is zero whatever the new tensor held."""

import numpy as np
import pytest
import torch

from vldist.data import collate
from vldist.data.collate import concat_rows, pad_regions


@pytest.fixture
def nan_buffers(monkeypatch):
    """New batch tensors full of NaN: padding must be written, not assumed."""
    monkeypatch.setattr(collate, "batch_tensor", lambda shape: torch.full(shape, float("nan")))


def _features(counts, dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim)).astype(dtype) for n in counts]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_pad_regions_equals_numpy_padding(nan_buffers, dtype):
    features = _features([3, 0, 7, 5], 6, dtype)
    regions, mask = pad_regions(features, max_regions=5)
    expected = np.zeros((4, 5, 6), np.float32)
    for i, f in enumerate(features):
        expected[i, : min(len(f), 5)] = f[:5].astype(np.float32)
    assert regions.dtype == torch.float32
    assert np.array_equal(regions.numpy(), expected)  # padding rows exactly 0, regions past K cut
    assert mask.tolist() == [[i < min(n, 5) for i in range(5)] for n in (3, 0, 7, 5)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_concat_rows_equals_numpy_concatenation(nan_buffers, dtype):
    features = _features([2, 0, 4], 3, dtype) + [np.zeros((0, 3), dtype)]
    rows = concat_rows(features, 3)
    assert rows.dtype == torch.float32
    assert np.array_equal(rows.numpy(), np.concatenate(features).astype(np.float32))
