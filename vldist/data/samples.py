"""Decoding the members every region-feature recipe reads: the JSON metadata and regions.npy.

Both raise ValueError naming the sample on corrupt input; the pipeline then skips and counts it.
"""

from __future__ import annotations

import functools
import io
import json
import math

import numpy as np

from vldist.errors import ShardsUnfitError


def read_meta(raw: dict) -> dict:
    """The sample's JSON metadata, which must hold at least one caption."""
    meta = json.loads(raw["json"])
    if not meta.get("captions"):
        raise ValueError(f"sample {raw['__key__']} has no captions")
    return meta


def read_regions(raw: dict, feature_dim: int | None) -> np.ndarray:
    """regions.npy as a (R > 0, feature_dim) array of finite values."""
    regions = load_npy(raw["regions.npy"])
    if regions.ndim != 2 or regions.shape[0] == 0:
        raise ValueError(f"regions.npy of {raw['__key__']} has shape {regions.shape}, expected (R>0, F)")
    if feature_dim is not None and regions.shape[1] != feature_dim:
        raise ValueError(f"regions.npy of {raw['__key__']} has {regions.shape[1]} features, expected {feature_dim}")
    if not np.isfinite(regions).all():
        raise ValueError(f"regions.npy of {raw['__key__']} holds NaN or inf")
    return regions


def load_npy(data: bytes) -> np.ndarray:
    """np.load(io.BytesIO(data), allow_pickle=False), the same array, without parsing a header seen
    before: numpy parses each header with ast.literal_eval, about 0.1 ms, a third of loading one
    image's proposals; a shard's arrays share a few headers. Anything but a plain C-order array of
    a version 1 or 2 header (and any damage) goes to np.load, whose errors name the problem."""
    if data[:6] == b"\x93NUMPY" and data[6:7] in (b"\x01", b"\x02"):
        size = 2 if data[6] == 1 else 4
        end = 8 + size + int.from_bytes(data[8 : 8 + size], "little")
        header = _npy_header(bytes(data[:end]))
        if header is not None:
            dtype, shape = header
            count = math.prod(shape)
            if len(data) - end >= count * dtype.itemsize:
                return np.frombuffer(data, dtype, count, end).reshape(shape).copy()
    return np.load(io.BytesIO(data), allow_pickle=False)


@functools.lru_cache(maxsize=64)
def _npy_header(prefix: bytes) -> tuple[np.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of a .npy header as numpy reads it; None where `load_npy` leaves it to np.load."""
    read = np.lib.format.read_array_header_1_0 if prefix[6] == 1 else np.lib.format.read_array_header_2_0
    try:
        shape, fortran_order, dtype = read(io.BytesIO(prefix[8:]))
    except ValueError:
        return None
    return None if fortran_order or dtype.hasobject else (dtype, shape)


def require_region_features(feature_dim: int | None, shards: str, recipe: str) -> int:
    """The shard set's feature width, or the error that says how to add features."""
    if feature_dim is None:
        raise ShardsUnfitError(
            f"the shard set {shards} has no region features (no features.dim in its manifest, no regions.npy "
            f"in its samples), and {recipe} reads them. Convert the images again with --features "
            "(python -m vldist.shards convert FORMAT ... --features)."
        )
    return feature_dim
