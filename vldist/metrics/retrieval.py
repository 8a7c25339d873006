"""Image-text retrieval metrics: R@K, median and mean rank, rsum (VSE++ / SCAN / VSRN protocol).

Layout (COCO / Flickr30K): `sims` is (n_images x n_captions) with `captions_per_image` captions per
image, and the captions of image i are columns i*cpi .. i*cpi+cpi-1.

Ties are broken against the query: a negative that scores *equal* to the ground truth is ranked
ahead of it. So a degenerate model (e.g. a constant similarity matrix) gets the worst ranks rather
than perfect recall, which is what an argsort-based evaluation can silently report.
"""

from __future__ import annotations

import numpy as np

RECALL_KS = (1, 5, 10)
# Rows (i2t) or columns (t2i) scored at a time: 256 x 25000 float64 is ~50 MB per chunk.
_CHUNK = 256


def _is_positive_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _as_matrix(sims, captions_per_image: int) -> np.ndarray:
    """float64 numpy array of `sims`, checked against the (n_images x n_images*cpi) layout."""
    if not _is_positive_int(captions_per_image):
        raise ValueError(f"captions_per_image must be a positive int, got {captions_per_image!r}")
    if hasattr(sims, "detach"):  # torch tensor: bf16/half cannot go to numpy directly
        sims = sims.detach().cpu().double().numpy()
    sims = np.asarray(sims, dtype=np.float64)
    if sims.ndim != 2:
        raise ValueError(
            f"sims must be 2-D (n_images x n_images*{captions_per_image}), got shape {sims.shape}")
    n_images, n_captions = sims.shape
    if n_images == 0 or n_captions != n_images * captions_per_image:
        raise ValueError(
            f"sims has shape {sims.shape}; expected (n_images, n_images*{captions_per_image}) = "
            f"({n_images}, {n_images * captions_per_image}) with n_images >= 1 "
            f"(captions_per_image={captions_per_image})")
    if not np.isfinite(sims).all():
        raise ValueError("sims contains NaN or infinite values")
    return sims


def _i2t_ranks(sims: np.ndarray, cpi: int) -> np.ndarray:
    """1-based rank of each image's best caption among all captions (pessimistic ties)."""
    n_images = sims.shape[0]
    ranks = np.empty(n_images, dtype=np.int64)
    for start in range(0, n_images, _CHUNK):
        rows = np.arange(start, min(start + _CHUNK, n_images))
        block = sims[rows].copy()
        pos_cols = rows[:, None] * cpi + np.arange(cpi)  # (chunk, cpi)
        best = np.take_along_axis(block, pos_cols, axis=1).max(axis=1)
        # Remove the image's own captions so only negatives are counted against it.
        np.put_along_axis(block, pos_cols, -np.inf, axis=1)
        ranks[rows] = 1 + (block >= best[:, None]).sum(axis=1)
    return ranks


def _t2i_ranks(sims: np.ndarray, cpi: int) -> np.ndarray:
    """1-based rank of each caption's image among all images (pessimistic ties)."""
    n_images, n_captions = sims.shape
    ranks = np.empty(n_captions, dtype=np.int64)
    for start in range(0, n_captions, _CHUNK):
        cols = np.arange(start, min(start + _CHUNK, n_captions))
        block = sims[:, cols]  # (n_images, chunk)
        true = block[cols // cpi, np.arange(len(cols))]
        # The true image always satisfies >= itself; every other hit is a negative ranked ahead.
        ranks[cols] = (block >= true[None, :]).sum(axis=0)
    return ranks


def _summarise(ranks: np.ndarray, prefix: str) -> dict[str, float]:
    out = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks <= k)) for k in RECALL_KS}
    # floor(median) of 1-based ranks == VSE++'s floor(median(rank0)) + 1.
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)))
    out[f"{prefix}_meanr"] = float(ranks.mean())
    return out


def retrieval_recall(sims, captions_per_image: int = 5) -> dict[str, float]:
    """i2t/t2i R@1/5/10 (percent), medr, meanr and rsum for one (n_images x n_captions) matrix."""
    sims = _as_matrix(sims, captions_per_image)
    out = _summarise(_i2t_ranks(sims, captions_per_image), "i2t")
    out.update(_summarise(_t2i_ranks(sims, captions_per_image), "t2i"))
    out["rsum"] = float(sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_KS))
    return out


def retrieval_protocols(sims, captions_per_image: int = 5, fold_size: int = 1000
                        ) -> dict[str, dict[str, float]]:
    """{"full": ...} plus, with >= 5*fold_size images, "1k_5fold": the MS-COCO 1K protocol.

    1K protocol: the first 5*fold_size images are split into 5 folds of `fold_size` images (with
    their captions), each fold is evaluated on its own, and every metric is averaged over folds.
    """
    if not _is_positive_int(fold_size):
        raise ValueError(f"fold_size must be a positive int, got {fold_size!r}")
    sims = _as_matrix(sims, captions_per_image)
    out = {"full": retrieval_recall(sims, captions_per_image)}
    if sims.shape[0] >= 5 * fold_size:
        cols = fold_size * captions_per_image
        folds = [retrieval_recall(sims[f * fold_size:(f + 1) * fold_size, f * cols:(f + 1) * cols],
                                  captions_per_image) for f in range(5)]
        out["1k_5fold"] = {k: float(np.mean([fold[k] for fold in folds])) for k in folds[0]}
    return out
