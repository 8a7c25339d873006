"""Image-text retrieval metrics: R@K, median and mean rank, rsum (VSE++ / SCAN / VSRN protocol).

`sims` is (n_images x n_captions): row i scores image i against every caption. Two layouts say
which captions belong to which image:

* Regular (COCO / Flickr30K), the positional `captions_per_image` (cpi): n_captions = n_images*cpi
  and the captions of image i are columns i*cpi .. i*cpi+cpi-1.
* Any number of captions per image (Conceptual Captions: one; users' folders: it varies), the
  keyword `caption_images`: one int per caption, `caption_images[j]` = the image caption j
  describes. Columns may come in any order; every image needs at least one caption. When it is
  given, `captions_per_image` is ignored, so callers can keep passing their configured cpi.

i2t: each image is a query; its rank is that of its best caption among all captions. t2i: each
caption is a query; its rank is that of its image among all images.

Ties are broken against the query: a negative that scores *equal* to the ground truth is ranked
ahead of it. So a degenerate model (e.g. a constant similarity matrix) gets the worst ranks rather
than perfect recall, which is what an argsort-based evaluation can silently report.
"""

from __future__ import annotations

import numpy as np

from vldist.metrics.indices import image_indices
from vldist.metrics.numpy_input import to_numpy

RECALL_KS = (1, 5, 10)
# Image rows scored at a time: 256 x 25000 float64 is ~50 MB per chunk.
_CHUNK = 256


def _is_positive_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _as_2d(sims, layout: str) -> np.ndarray:
    sims = to_numpy(sims, float64=True)
    if sims.ndim != 2:
        raise ValueError(f"sims must be 2-D ({layout}), got shape {sims.shape}")
    return sims


def _regular_layout(sims, captions_per_image) -> tuple[np.ndarray, np.ndarray]:
    if not _is_positive_int(captions_per_image):
        raise ValueError(f"captions_per_image must be a positive int, got {captions_per_image!r}")
    sims = _as_2d(sims, f"n_images x n_images*{captions_per_image}")
    n_images, n_captions = sims.shape
    if n_images == 0 or n_captions != n_images * captions_per_image:
        raise ValueError(
            f"sims has shape {sims.shape}; expected (n_images, n_images*{captions_per_image}) = "
            f"({n_images}, {n_images * captions_per_image}) with n_images >= 1 "
            f"(captions_per_image={captions_per_image})"
        )
    return sims, np.repeat(np.arange(n_images, dtype=np.int64), captions_per_image)


def _check_caption_images(caption_images, n_images: int, n_captions: int) -> np.ndarray:
    """`caption_images` as an int64 array, checked against (n_images x n_captions) sims."""
    idx = image_indices(
        caption_images, "caption_images", n_captions, "sims.shape[1]", "caption", n_images, "sims.shape[0]"
    )
    missing = np.flatnonzero(np.bincount(idx, minlength=n_images) == 0)
    if missing.size:
        raise ValueError(
            f"image {int(missing[0])} has no caption in caption_images ({missing.size} image(s) "
            f"without captions); i2t is undefined for an image without captions"
        )
    return idx


def _prepare(sims, captions_per_image, caption_images) -> tuple[np.ndarray, np.ndarray]:
    """float64 sims and the image index of every caption, in either layout, validated."""
    if caption_images is None:
        sims, caption_images = _regular_layout(sims, captions_per_image)
    else:
        sims = _as_2d(sims, "n_images x n_captions")
        if sims.shape[0] == 0:
            raise ValueError(f"sims has shape {sims.shape}; expected n_images >= 1")
        caption_images = _check_caption_images(caption_images, *sims.shape)
    if not np.isfinite(sims).all():
        raise ValueError("sims contains NaN or infinite values")
    return sims, caption_images


def _i2t_ranks(sims: np.ndarray, caption_images: np.ndarray) -> np.ndarray:
    """1-based rank of each image's best caption among all captions (pessimistic ties)."""
    n_images = sims.shape[0]
    # Columns grouped by image (stable: ties keep column order), so the captions of a chunk of
    # images are one contiguous run of `order`, cut into per-image segments at `starts`.
    order = np.argsort(caption_images, kind="stable")
    starts = np.concatenate(([0], np.cumsum(np.bincount(caption_images, minlength=n_images))))
    ranks = np.empty(n_images, dtype=np.int64)
    for lo in range(0, n_images, _CHUNK):
        hi = min(lo + _CHUNK, n_images)
        block = sims[lo:hi]
        pos_cols = order[starts[lo] : starts[hi]]
        pos_rows = caption_images[pos_cols] - lo
        pos = block[pos_rows, pos_cols]
        segments = starts[lo:hi] - starts[lo]  # every segment non-empty: reduceat is safe
        best = np.maximum.reduceat(pos, segments)
        at_least_best = np.count_nonzero(block >= best[:, None], axis=1)
        # Own captions scoring >= the best (the best itself and ties) are not negatives.
        own = np.add.reduceat((pos >= best[pos_rows]).astype(np.int64), segments)
        ranks[lo:hi] = 1 + at_least_best - own
    return ranks


def _t2i_ranks(sims: np.ndarray, caption_images: np.ndarray) -> np.ndarray:
    """1-based rank of each caption's image among all images (pessimistic ties)."""
    n_images, n_captions = sims.shape
    true = sims[caption_images, np.arange(n_captions)]
    # Count, per caption, the images scoring >= its true image; the true image counts itself, so
    # the count is the 1-based rank. Row chunks read `sims` contiguously.
    ranks = np.zeros(n_captions, dtype=np.int64)
    for lo in range(0, n_images, _CHUNK):
        ranks += np.count_nonzero(sims[lo : lo + _CHUNK] >= true, axis=0)
    return ranks


def _summarise(ranks: np.ndarray, prefix: str) -> dict[str, float]:
    out = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks <= k)) for k in RECALL_KS}
    # floor(median) of 1-based ranks == VSE++'s floor(median(rank0)) + 1.
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)))
    out[f"{prefix}_meanr"] = float(ranks.mean())
    return out


def _evaluate(sims: np.ndarray, caption_images: np.ndarray) -> dict[str, float]:
    out = _summarise(_i2t_ranks(sims, caption_images), "i2t")
    out.update(_summarise(_t2i_ranks(sims, caption_images), "t2i"))
    out["rsum"] = float(sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_KS))
    return out


def retrieval_recall(sims, captions_per_image: int = 5, *, caption_images=None) -> dict[str, float]:
    """i2t/t2i R@1/5/10 (percent), medr, meanr and rsum for one (n_images x n_captions) matrix.

    `caption_images` (one image index per caption, any order) replaces the regular
    `captions_per_image` layout; `captions_per_image` is then ignored.
    """
    return _evaluate(*_prepare(sims, captions_per_image, caption_images))


def retrieval_protocols(
    sims, captions_per_image: int = 5, fold_size: int = 1000, *, caption_images=None
) -> dict[str, dict[str, float]]:
    """{"full": ...} plus, with >= 5*fold_size images, "1k_5fold": the MS-COCO 1K protocol.

    1K protocol: the first 5*fold_size images are split into 5 folds of `fold_size` images, each
    fold is evaluated on its own with exactly its images' captions (wherever their columns are),
    and every metric is averaged over folds. `caption_images` as in `retrieval_recall`.
    """
    if not _is_positive_int(fold_size):
        raise ValueError(f"fold_size must be a positive int, got {fold_size!r}")
    sims, caption_images = _prepare(sims, captions_per_image, caption_images)
    out = {"full": _evaluate(sims, caption_images)}
    if sims.shape[0] >= 5 * fold_size:
        folds = []
        for lo in range(0, 5 * fold_size, fold_size):
            cols = np.flatnonzero((caption_images >= lo) & (caption_images < lo + fold_size))
            folds.append(_evaluate(sims[lo : lo + fold_size][:, cols], caption_images[cols] - lo))
        out["1k_5fold"] = {k: float(np.mean([fold[k] for fold in folds])) for k in folds[0]}
    return out
