"""Sentence-to-sentence retrieval recall (two-branch networks, Wang, Li & Lazebnik, TPAMI, Table 4).

Every sentence is a query against all the *other* sentences (itself excluded), ranked by `sims`
(M x M, higher is better: dot products of the text embeddings, negative Euclidean distances, ...).
A query is correct at K when at least one other sentence describing the same image is among its
top K. Its rank is that of its best same-image sentence.

A sentence whose image has no other sentence cannot be answered at all; such queries are left out
of the denominator and counted in "n_without_neighbour" (Flickr30K / COCO have 5 sentences per image,
so there are none; users' data may have single-caption images).

Ties are broken against the query, as in `vldist.metrics.retrieval`: a sentence of another image
that scores *equal* to the best same-image sentence is ranked ahead of it, so a model that scores
everything alike gets the worst ranks. Other same-image sentences tied with the best do not count
against it (whichever is listed first, it is a correct one). The rank is therefore 1 + the number
of other-image sentences scoring >= the best same-image score.

The diagonal (a sentence against itself) is never read: +inf, NaN, anything is fine there.
"""

from __future__ import annotations

import numpy as np

from vldist.metrics.indices import image_indices
from vldist.metrics.ks import check_ks
from vldist.metrics.numpy_input import to_numpy

SENTENCE_RETRIEVAL_KS = (1, 5, 10)
# Query rows scored at a time: 256 x 25000 float64 is ~50 MB per chunk, so a 25k-sentence matrix is
# never copied whole (a float32 or torch input stays in its own dtype; only a chunk is float64).
_CHUNK = 256


def _check_sims(sims):
    """`sims` as a square 2-D tensor or numpy array, NOT converted to float64 (see `_rows`)."""
    if not hasattr(sims, "detach"):
        sims = np.asarray(sims)  # no copy for an ndarray
    shape = tuple(sims.shape)
    if len(shape) != 2 or shape[0] != shape[1] or shape[0] == 0:
        raise ValueError(
            f"sims must be a square (M x M) matrix with M >= 1, sims[i, j] = similarity "
            f"of sentence i to sentence j; got shape {shape}"
        )
    return sims


def _rows(sims, lo: int, hi: int) -> np.ndarray:
    """A float64 copy of rows lo:hi of `sims` (a copy: the caller writes into it)."""
    return to_numpy(sims[lo:hi], float64=True, copy=True)


def sentence_to_sentence_ranks(sims, sentence_images) -> np.ndarray:
    """Per sentence, the 1-based rank of its best same-image sentence among all other sentences
    (pessimistic ties); 0 for a sentence whose image has no other sentence."""
    sims = _check_sims(sims)
    m = sims.shape[0]
    images = image_indices(sentence_images, "sentence_images", m, "sims.shape[0]", "sentence", what="image id")
    ranks = np.zeros(m, dtype=np.int64)
    for lo in range(0, m, _CHUNK):
        hi = min(lo + _CHUNK, m)
        block = _rows(sims, lo, hi)
        rows = np.arange(hi - lo)
        nan = np.isnan(block)
        nan[rows, rows + lo] = False  # the diagonal is ignored, whatever it holds
        if nan.any():
            i, j = np.argwhere(nan)[0]
            raise ValueError(
                f"sims[{lo + i}, {j}] is NaN ({int(nan.sum())} NaN off the diagonal in "
                f"rows {lo}..{hi - 1}); similarities must be comparable numbers"
            )
        same = images[lo:hi, None] == images[None, :]
        same[rows, rows + lo] = False  # a sentence is not its own neighbour
        # The query itself becomes NaN: NaN >= x is False, so it never counts as ranked ahead.
        block[rows, rows + lo] = np.nan
        has_neighbour = same.any(axis=1)
        best = np.where(same, block, -np.inf).max(axis=1)
        # Other-image sentences scoring >= the best same-image one rank ahead of it (pessimistic).
        ahead = np.count_nonzero((block >= best[:, None]) & ~same, axis=1)
        ranks[lo:hi] = np.where(has_neighbour, 1 + ahead, 0)
    return ranks


def sentence_to_sentence_recall(sims, sentence_images, ks=(1, 5, 10)) -> dict:
    """{"r{k}": percent of queries with a same-image sentence in their top k, ..., "median_rank",
    "n_queries", "n_without_neighbour"}.

    sims: (M x M) tensor (any float dtype, bf16 included) or array, sims[i, j] = similarity of
        sentence i to sentence j, higher is better; +-inf allowed, NaN only on the ignored diagonal.
    sentence_images: M ints (any ids), sentence_images[j] = the image sentence j describes.
    Queries without a same-image neighbour are excluded from r{k} and median_rank; "n_queries"
    is the number of queries that count, "n_without_neighbour" the number left out. median_rank
    is the floored median of the 1-based ranks (the VSE++ convention of `retrieval_recall`).
    """
    ks = check_ks(ks)
    ranks = sentence_to_sentence_ranks(sims, sentence_images)
    counted = ranks[ranks > 0]
    if counted.size == 0:
        raise ValueError(
            f"none of the {ranks.size} sentences shares its image with another "
            f"sentence (sentence_images has no repeated id): recall is undefined"
        )
    out: dict = {f"r{k}": float(100.0 * np.mean(counted <= k)) for k in ks}
    out["median_rank"] = float(np.floor(np.median(counted)))
    out["n_queries"] = int(counted.size)
    out["n_without_neighbour"] = int(ranks.size - counted.size)
    return out
