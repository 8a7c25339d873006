"""Text-image consistency metrics of LAViTeR (notes-laviter.md, Evaluation): R-precision, AIMCoS.

R-precision (AttnGAN's protocol, Xu et al. 2018; reported by LAViTeR in Tables 2-3): every image
is a query against a pool of `candidates` captions, its own caption plus `candidates` - 1 captions
of *other* images drawn at random (AttnGAN: 100 = 1 + 99). The pool is ranked by the cosine of the
global image vector with each sentence vector; R-precision is the percent of images whose own
caption ranks within the top k (k = 1 in AttnGAN; LAViTeR also mentions top-3).

Choices made here:

* Own caption: one caption per image, chosen by the caller. `text[i]` is image i's own caption;
  with several captions per image the caller picks which one (the first, a random one, ...) and
  the other captions of image i are not in the pool (the distractors are captions of other images,
  one per image).
* Pools: for image i, `candidates` - 1 distinct images j != i, drawn without replacement, their
  captions `text[j]` are the distractors. The draw depends only on (N, candidates, seed), never on
  the vectors or their device: a CPU `torch.Generator` seeded with `seed` draws, row chunk by row
  chunk in image order, float64 uniform keys `torch.rand((rows, N))`; image i's own column gets
  +inf and its distractors are the `candidates` - 1 smallest keys of its row (a uniformly random
  subset of the other images). `_pools(n, candidates, seed)` returns them (column 0: the image
  itself), so a test or a caller can rebuild the exact pools.
* Ties are broken against the query: a distractor whose cosine is >= the own caption's ranks ahead
  of it, so the rank is 1 + the number of such distractors and a model that embeds every caption
  alike scores 0 at k < candidates rather than 100.
* N < candidates is an error (the pool cannot be filled with distinct other captions), not a
  silently smaller pool: pass fewer candidates.

AIMCoS (LAViTeR, Eq. 17): (1/N) sum_n (1/K_n) sum_k cos(v_n, e_{n,k}), v_n the global vector of
image n and e_{n,k} the sentence vector of its k-th attribute text (CUB: attribute phrases; COCO:
class names). Each image weighs the same whatever its number of attribute texts K_n; images with no
attribute text are left out of the mean (N counts only images with K_n >= 1). It is a mean cosine
in [-1, 1], not a percent (LAViTeR reports e.g. 0.5063).

Cosines are computed in float64 on CPU, in chunks of images, so N = 5000 (COCO test) with
100 candidates and D = 512 needs a few tens of MB.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vldist.metrics.indices import image_indices

# Images whose pools are drawn at a time: 256 x N float64 keys (256 x 25000 is ~50 MB).
_POOL_CHUNK = 256
# Images scored at a time: 64 x candidates x D float64 (64 x 100 x 512 is ~26 MB).
_SCORE_CHUNK = 64
# Attribute texts scored at a time in `aimcos`.
_ATTR_CHUNK = 4096


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _vectors(x, name: str) -> torch.Tensor:
    """`x` (tensor, any float dtype and device, or array-like) as a float64 CPU (rows, D) tensor
    of finite, non-zero rows; ValueError otherwise."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu", torch.float64)
    else:
        x = torch.as_tensor(np.asarray(x, dtype=np.float64))
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, D), got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    norms = torch.linalg.vector_norm(x, dim=1)
    zero = torch.nonzero(norms == 0).flatten()
    if zero.numel():
        raise ValueError(
            f"{name}[{int(zero[0])}] is a zero vector ({zero.numel()} zero row(s) in "
            f"{name}): its cosine with anything is undefined"
        )
    return x / norms[:, None]


def _pools(n: int, candidates: int, seed: int) -> torch.Tensor:
    """(n, candidates) int64: row i = [i, then candidates - 1 distinct images j != i].

    See the module docstring for the draw; the distractors are in increasing key order.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))  # int(): manual_seed refuses numpy ints
    pools = torch.empty((n, candidates), dtype=torch.int64)
    pools[:, 0] = torch.arange(n)
    if candidates == 1:
        return pools
    for lo in range(0, n, _POOL_CHUNK):
        hi = min(lo + _POOL_CHUNK, n)
        keys = torch.rand((hi - lo, n), generator=generator, dtype=torch.float64)
        rows = torch.arange(hi - lo)
        keys[rows, rows + lo] = math.inf  # never its own distractor
        nearest = torch.topk(keys, candidates - 1, dim=1, largest=False, sorted=True)
        pools[lo:hi, 1:] = nearest.indices
    return pools


def r_precision(image, text, candidates=100, seed=0, k=1) -> float:
    """Percent (0-100) of images whose own caption ranks within the top k of its pool.

    image: (N, D) global image vectors; text: (N, D) sentence vectors, text[i] the own caption of
        image i (tensors of any float dtype/device, or arrays).
    candidates: pool size, the own caption plus candidates - 1 captions of other images (<= N).
    seed: seeds the CPU generator that draws the pools (same seed, same N, same pools).
    k: the own caption counts when at most k - 1 distractors have a cosine >= its own.
    """
    if not _is_int(candidates) or candidates < 1:
        raise ValueError(f"candidates must be a positive int, got {candidates!r}")
    if not _is_int(k) or not 1 <= k <= candidates:
        raise ValueError(f"k must be an int in 1..candidates = 1..{candidates}, got {k!r}")
    if not _is_int(seed) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be an int in -2**63..2**64-1 (torch.Generator), got {seed!r}")
    image = _vectors(image, "image")
    text = _vectors(text, "text")
    if image.shape != text.shape:
        raise ValueError(
            f"image and text must both be (N, D) with text[i] the caption of image i; "
            f"got image {tuple(image.shape)} and text {tuple(text.shape)}"
        )
    n = image.shape[0]
    if n < candidates:
        raise ValueError(
            f"R-precision with candidates={candidates} needs at least {candidates} "
            f"images (own caption + {candidates - 1} captions of other images), but "
            f"there are only {n} images: pass fewer candidates (candidates <= {n})"
        )
    pools = _pools(n, candidates, seed)
    hits = 0
    for lo in range(0, n, _SCORE_CHUNK):
        hi = min(lo + _SCORE_CHUNK, n)
        # Elementwise product and a sum over D: the same reduction for every pool entry, so equal
        # caption vectors get bitwise-equal cosines (exact ties stay ties).
        cos = (text[pools[lo:hi]] * image[lo:hi, None, :]).sum(dim=-1)  # (rows, candidates)
        ahead = torch.count_nonzero(cos[:, 1:] >= cos[:, :1], dim=1)  # ties against the query
        hits += int(torch.count_nonzero(ahead < k))
    return 100.0 * hits / n


def aimcos(image, attributes, owners) -> float:
    """AIMCoS (LAViTeR Eq. 17): mean over images with >= 1 attribute text of the mean cosine
    between the image vector and its attribute texts' sentence vectors.

    image: (N, D) global image vectors; attributes: (M, D) sentence vectors of attribute texts;
    owners: (M,) ints, owners[m] = the image attribute text m belongs to (any order, any count per
    image, images without attribute texts are left out).
    """
    image = _vectors(image, "image")
    n = image.shape[0]
    empty = attributes.numel() == 0 if hasattr(attributes, "detach") else np.size(attributes) == 0
    if empty:
        raise ValueError(f"no image has an attribute text (attributes is empty; {n} images): AIMCoS is undefined")
    attributes = _vectors(attributes, "attributes")
    if attributes.shape[1] != image.shape[1]:
        raise ValueError(
            f"image and attributes must have the same width D; got image "
            f"{tuple(image.shape)} and attributes {tuple(attributes.shape)}"
        )
    m = attributes.shape[0]
    owners = torch.from_numpy(
        image_indices(owners, "owners", m, "attributes.shape[0]", "attribute text", n, "image.shape[0]")
    )
    cos = torch.empty(m, dtype=torch.float64)
    for lo in range(0, m, _ATTR_CHUNK):
        hi = min(lo + _ATTR_CHUNK, m)
        cos[lo:hi] = (image[owners[lo:hi]] * attributes[lo:hi]).sum(dim=1)
    counts = torch.bincount(owners, minlength=n)
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, owners, cos)
    has = counts > 0
    return float((sums[has] / counts[has]).mean())
