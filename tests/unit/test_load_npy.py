"""data/samples.py's load_npy returns what np.load returns, as a writable array of its own, and
raises np.load's errors on damaged bytes."""

import io

import numpy as np
import pytest

from vldist.data.samples import load_npy


def _npy(array, version=None) -> bytes:
    out = io.BytesIO()
    if version is None:
        np.save(out, array)
    else:
        np.lib.format.write_array(out, array, version=version)
    return out.getvalue()


ARRAYS = [
    np.random.default_rng(0).standard_normal((32, 2048)).astype(np.float16),
    np.arange(12, dtype=np.int64).reshape(3, 4),
    np.zeros((0, 5), np.float32),
    np.asfortranarray(np.arange(6.0).reshape(2, 3)),  # left to np.load
    np.array(3.5),
    np.array(["ab", "c"]),
    np.arange(4, dtype=">f4"),  # big-endian
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
@pytest.mark.parametrize("version", [None, (2, 0)])
def test_load_npy_equals_np_load(array, version):
    data = _npy(array, version)
    for _ in range(2):  # the second read takes the remembered header
        got = load_npy(data)
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
        assert got.flags.writeable  # a copy, not a read-only view of the bytes


@pytest.mark.parametrize(
    "damage",
    [lambda d: d[:40], lambda d: d[:-10], lambda d: b"not an array at all", lambda d: d[:8] + b"\xff\xff" + d[10:]],
    ids=["cut header", "cut data", "no npy", "bad header length"],
)
def test_damaged_bytes_raise_what_np_load_raises(damage):
    data = damage(_npy(np.arange(100, dtype=np.float32).reshape(10, 10)))
    with pytest.raises(ValueError) as ours:
        load_npy(data)
    with pytest.raises(ValueError) as numpys:
        np.load(io.BytesIO(data), allow_pickle=False)
    assert str(ours.value) == str(numpys.value)
