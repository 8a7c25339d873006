"""Decoding the members every region-feature recipe reads: the JSON metadata and regions.npy.

Both raise ValueError naming the sample on corrupt input; the pipeline then skips and counts it.
"""

from __future__ import annotations

import io
import json

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
    regions = np.load(io.BytesIO(raw["regions.npy"]), allow_pickle=False)
    if regions.ndim != 2 or regions.shape[0] == 0:
        raise ValueError(f"regions.npy of {raw['__key__']} has shape {regions.shape}, expected (R>0, F)")
    if feature_dim is not None and regions.shape[1] != feature_dim:
        raise ValueError(f"regions.npy of {raw['__key__']} has {regions.shape[1]} features, expected {feature_dim}")
    if not np.isfinite(regions).all():
        raise ValueError(f"regions.npy of {raw['__key__']} holds NaN or inf")
    return regions


def require_region_features(feature_dim: int | None, shards: str, recipe: str) -> int:
    """The shard set's feature width, or the error that says how to add features."""
    if feature_dim is None:
        raise ShardsUnfitError(
            f"the shard set {shards} has no region features (no features.dim in its manifest, no regions.npy "
            f"in its samples), and {recipe} reads them. Convert the images again with --features "
            "(python -m vldist.shards convert FORMAT ... --features)."
        )
    return feature_dim
