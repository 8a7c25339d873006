"""The region-feature standardisation stored beside a shard set's manifest.

RegionFeatureExtractor.calibrate() sets a per-dimension (shift, scale), and every stored feature
row is `(pooled - shift) * scale`. Without them nobody can compute features for a new image that
match the set's, so the builders write them into `<set>/feature_standardization.safetensors`
(float32 tensors `shift` and `scale`, each of shape (features.dim,)) and name the file in the
manifest: `features.standardization`. The bytes depend only on the values (no timestamps), so a
rebuild with the same statistics gives the same file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vldist.shards.format.layout import STANDARDIZATION_NAME


def save_standardization(directory: str | Path, shift, scale) -> str:
    """Write (shift, scale) into `directory` (via a .tmp file and a rename); returns the file name."""
    from safetensors.numpy import save

    shift = np.ascontiguousarray(shift, dtype=np.float32)
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    if shift.ndim != 1 or shift.shape != scale.shape:
        raise ValueError(f"shift and scale must be 1-D of one length, got {shift.shape} and {scale.shape}")
    path = Path(directory) / STANDARDIZATION_NAME
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(save({"scale": scale, "shift": shift}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.name


def load_standardization(path: str | Path, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale) from a stored file; ValueError naming the file when it is damaged or does not
    fit `dim` features."""
    from safetensors.numpy import load_file

    path = Path(path)
    try:
        tensors = load_file(path)
        shift, scale = tensors["shift"], tensors["scale"]
    except Exception as err:  # noqa: BLE001 - safetensors raises several types on damage
        raise ValueError(
            f"cannot read the feature standardisation {path} ({type(err).__name__}: {err}); the shard set is damaged"
        ) from None
    if shift.ndim != 1 or shift.shape != scale.shape or (dim is not None and shift.shape[0] != dim):
        raise ValueError(
            f"{path} holds shift {shift.shape} and scale {scale.shape}; the manifest's features "
            f"have dim {dim}: the shard set is damaged"
        )
    if not (np.isfinite(shift).all() and np.isfinite(scale).all()):
        raise ValueError(f"{path} holds NaN or inf; the shard set is damaged")
    return shift, scale


def standardization_in(setup) -> tuple[np.ndarray, np.ndarray] | None:
    """(shift, scale) of a converter's worker setup when it has them (the image converters'
    calibrated_setup: a dict with "shift" and "scale"); None for setups without an extractor."""
    if isinstance(setup, dict) and "shift" in setup and "scale" in setup:
        return setup["shift"], setup["scale"]
    return None
