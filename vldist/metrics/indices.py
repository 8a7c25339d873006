"""The image-index vectors the metrics take (which image each caption, sentence or attribute text
belongs to), checked once: shape, integer dtype and, when the image count is known, range."""

from __future__ import annotations

import numpy as np

from vldist.metrics.numpy_input import to_numpy


def image_indices(
    values,
    name: str,
    count: int,
    count_source: str,
    per: str,
    n_images: int | None = None,
    images_source: str = "",
    what: str = "image index",
) -> np.ndarray:
    """`values` (array, list or tensor) as a 1-D int64 array of `count` entries, one `what` per
    `per`; with `n_images`, every entry must lie in 0..n_images-1. The errors name `name`, the
    expected length's source (`count_source`) and the first bad entry."""
    idx = to_numpy(values)  # the dtype kept: it is checked below
    if idx.ndim != 1 or idx.shape[0] != count:
        raise ValueError(
            f"{name} must be 1-D with one {what} per {per} ({count_source} = {count}), got shape {idx.shape}"
        )
    if idx.size == 0:
        idx = idx.astype(np.int64)  # np.asarray([]) is float64
    # bool is an integer dtype to numpy, but surely not an image index.
    if not np.issubdtype(idx.dtype, np.integer) or idx.dtype == np.bool_:
        plural = what.removesuffix("index") + "indices" if what.endswith("index") else what + "s"
        raise ValueError(f"{name} must hold integer {plural}, got dtype {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if n_images is not None:
        bad = np.flatnonzero((idx < 0) | (idx >= n_images))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"{name}[{j}] = {idx[j]} is out of range: image indices must be in "
                f"0..{n_images - 1} for {n_images} images ({images_source}); "
                f"{bad.size} of {count} out of range"
            )
    return idx
