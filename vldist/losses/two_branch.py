"""The two-branch embedding network's bi-directional ranking loss with neighbourhood constraints
(Wang, Li & Lazebnik, TPAMI, Eq. 3-6), top-K violators, over the global batch.

Three terms, each a sum over (anchor, positive) pairs of the K largest hinges
[m + d(anchor, positive) - d(anchor, negative)]_+ among that anchor's negatives (all of them when
there are fewer than K), d the Euclidean distance:

    lambda_image           image anchor, one of its sentences positive, other images' sentences negative
    lambda_text            sentence anchor, its image positive, other images negative
    lambda_text_neighbors  sentence anchor, another sentence of its image positive, other images'
                           sentences negative (the neighbourhood constraint, lambda_4)

Sentences of the same image are never each other's negatives (the official code treats them as
such; the paper does not), nor are two copies of one image that a batch drawn with replacement
holds (rows of equal `identity`). The paper sums the hinges; the official code averages them.

Written by hand: no library has this loss. Each term is a sum over anchors, so a rank scores its
own anchors against the all-gathered candidates of every rank, and the ranks' shares add up to
the loss of the whole global batch (losses/distributed.py's convention).

Phrase localisation (`phrase_ranking_loss`, Algorithm 1 of the paper) pairs each phrase with its
positive region; the same bi-directional top-K hinges, two terms:

    lambda_image  region anchor (a phrase's positive region), the phrase positive; negatives: the
                  phrases of the global batch other than its chain's, and other than those the
                  region is a positive of (3.a: "a phrase from this mini-batch not in the same
                  coreference chain")
    lambda_text   phrase anchor, its positive region positive; negatives: the regions of its own
                  image with IoU < 0.3 with its chain's boxes (3.b), nothing else (`negatives_from`
                  "image", the paper); "batch" adds every region of the other images of the
                  global batch

What is a negative within an image comes from the boxes (data/phrases.py: `training_image`); a
copy of the image elsewhere in the batch (equal `identity`) gives no negative in either term.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from vldist.distributed.collectives import all_gather_rows, all_gather_with_grad, world
from vldist.losses.not_negative import gather_identities, local_identities
from vldist.losses.precision import in_loss_precision

# Inside the square root: the distance's gradient at d = 0 would be infinite (the official code
# adds 1e-4; this is smaller so that d stays within 1e-4 of the true distance).
_EPS = 1e-8


def euclidean(a: Tensor, b: Tensor) -> Tensor:
    """(A, D) x (B, D) -> (A, B) Euclidean distances, differentiable everywhere."""
    squared = (a * a).sum(1, keepdim=True) + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return (squared.clamp(min=0) + _EPS).sqrt()


def top_k_hinge_sum(
    anchor: Tensor, positive: Tensor, candidates: Tensor, negative: Tensor, margin: float, top_k: int
) -> Tensor:
    """Sum over rows of the `top_k` largest hinges [margin + d(anchor, positive) - d(anchor, c)]_+
    over the candidates c that `negative` (rows x candidates, bool) marks for that row."""
    if anchor.shape[0] == 0 or candidates.shape[0] == 0:
        return anchor.sum() * 0  # keeps the graph (and DDP's hooks) when a term has no pairs
    d_pos = (((anchor - positive) ** 2).sum(1) + _EPS).sqrt()
    cost = margin + d_pos[:, None] - euclidean(anchor, candidates)
    cost = cost.masked_fill(~negative, float("-inf"))
    # The largest hinges are the largest costs (clamping is monotone); -inf (not a negative, when
    # a row has fewer than K) clamps to 0 and adds nothing.
    worst = cost.topk(min(top_k, cost.shape[1]), dim=1).values
    return worst.clamp(min=0).sum()


def _ranking_loss(
    image: Tensor,
    text: Tensor,
    text_image: Tensor,
    all_image: Tensor,
    all_text: Tensor,
    all_text_image: Tensor,
    all_identity: Tensor,
    image_offset: int,
    margin: float,
    top_k: int,
    lambda_image: float,
    lambda_text: float,
    lambda_text_neighbors: float,
) -> Tensor:
    """Local anchors (image, text; text_image indexes `image`) against global candidates (all_*;
    all_text_image indexes `all_image`; this rank's images start at row `image_offset`).
    all_identity: each global image row's identity; rows of one identity are one image, never
    each other's negatives (a batch drawn with replacement can hold an image twice)."""
    own = text_image + image_offset  # each local sentence's image, as a global row
    own_identity = all_identity[own]
    other_image_text = own_identity[:, None] != all_identity[all_text_image][None, :]  # (M_local, M_global)
    total = image.sum() * 0
    if lambda_image:
        total = total + lambda_image * top_k_hinge_sum(all_image[own], text, all_text, other_image_text, margin, top_k)
    if lambda_text:
        total = total + lambda_text * top_k_hinge_sum(
            text, all_image[own], all_image, own_identity[:, None] != all_identity[None, :], margin, top_k
        )
    if lambda_text_neighbors:
        # (anchor, positive): every ordered pair of distinct sentences of one sample. The sentences
        # of a sample travel together, so a local anchor's neighbours are local too.
        same = text_image[:, None] == text_image[None, :]
        same.fill_diagonal_(False)
        anchors, positives = same.nonzero(as_tuple=True)
        total = total + lambda_text_neighbors * top_k_hinge_sum(
            text[anchors], text[positives], all_text, other_image_text[anchors], margin, top_k
        )
    return total


def _check(image: Tensor, text: Tensor, text_image: Tensor) -> None:
    if image.dim() != 2 or text.dim() != 2 or image.shape[1] != text.shape[1]:
        raise ValueError(
            f"image (N, D) and text (M, D) must be 2-D with the same D, got {tuple(image.shape)} "
            f"and {tuple(text.shape)}"
        )
    if text_image.shape != (text.shape[0],) or text_image.dtype != torch.long:
        raise ValueError(
            f"text_image must be a long tensor of shape ({text.shape[0]},), the image row of each "
            f"sentence; got {text_image.dtype} {tuple(text_image.shape)}"
        )
    if text_image.numel() and (int(text_image.min()) < 0 or int(text_image.max()) >= image.shape[0]):
        raise ValueError(
            f"text_image must index the {image.shape[0]} image rows, got values in "
            f"[{int(text_image.min())}, {int(text_image.max())}]"
        )


@in_loss_precision
def two_branch_ranking_loss(
    image: Tensor,
    text: Tensor,
    text_image: Tensor,
    margin: float = 0.1,
    top_k: int = 50,
    lambda_image: float = 1.0,
    lambda_text: float = 2.0,
    lambda_text_neighbors: float = 0.0,
    identity: Tensor | None = None,
) -> Tensor:
    """The loss of one batch in one process: `image` (N, D) and `text` (M, D) normalised
    embeddings, `text_image` (M,) the image row of each sentence, `identity` (N,) optional image
    ids (rows of one id are never each other's negatives). Returns the weighted sum of the three
    terms' top-K hinges (module docstring)."""
    _check(image, text, text_image)
    identity = torch.arange(image.shape[0], device=image.device) if identity is None else identity.to(image.device)
    return _ranking_loss(
        image,
        text,
        text_image,
        image,
        text,
        text_image,
        identity,
        0,
        margin,
        top_k,
        lambda_image,
        lambda_text,
        lambda_text_neighbors,
    )


@in_loss_precision
def cross_rank_two_branch_ranking_loss(
    image: Tensor,
    text: Tensor,
    text_image: Tensor,
    margin: float = 0.1,
    top_k: int = 50,
    lambda_image: float = 1.0,
    lambda_text: float = 2.0,
    lambda_text_neighbors: float = 0.0,
    gather: bool = True,
    identity: Tensor | None = None,
) -> Tensor:
    """This rank's share of `two_branch_ranking_loss` of the global batch: its anchors, with the
    top-K violators chosen among every rank's images and sentences (gathered with gradient). The
    shares sum to the loss of the ranks' batches concatenated. Without `gather`, each rank's slice
    is its own batch (cheaper, and a different loss). identity: (N,) image ids of this rank's
    image rows (batch["identity"]), gathered with them."""
    _check(image, text, text_image)
    if world()[1] == 1 or not gather:
        return two_branch_ranking_loss(
            image, text, text_image, margin, top_k, lambda_image, lambda_text, lambda_text_neighbors, identity
        )
    all_image, image_offset = all_gather_with_grad(image)
    all_text, _ = all_gather_with_grad(text)
    all_text_image = all_gather_rows(text_image + image_offset)[0]  # global image rows
    all_identity = gather_identities(identity, image.shape[0], image.device)[1]
    return _ranking_loss(
        image,
        text,
        text_image,
        all_image,
        all_text,
        all_text_image,
        all_identity,
        image_offset,
        margin,
        top_k,
        lambda_image,
        lambda_text,
        lambda_text_neighbors,
    )


# ---------------------------------------------------------------------------- phrase localisation


def top_k_pair_hinge_sum(
    anchor: Tensor, positive: Tensor, candidates: Tensor, pairs: Tensor, margin: float, top_k: int
) -> Tensor:
    """`top_k_hinge_sum` with each anchor's negatives listed as (anchor row, candidate row) pairs,
    (2, Q): only the listed distances are computed (a phrase against its own image's regions)."""
    if pairs.shape[1] == 0:
        return anchor.sum() * 0 + positive.sum() * 0
    rows, columns = pairs
    d_pos = (((anchor - positive) ** 2).sum(1) + _EPS).sqrt()
    cost = margin + d_pos[rows] - (((anchor[rows] - candidates[columns]) ** 2).sum(1) + _EPS).sqrt()
    # one row per anchor, its costs side by side, -inf where it has fewer than the widest
    order = torch.argsort(rows, stable=True)
    rows = rows[order]
    counts = torch.bincount(rows, minlength=anchor.shape[0])
    slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    table = cost.new_full((anchor.shape[0], int(counts.max())), float("-inf")).index_put((rows, slot), cost[order])
    return table.topk(min(top_k, table.shape[1]), dim=1).values.clamp(min=0).sum()


def _scatter(mask: Tensor, pairs: Tensor, column_offset: int) -> Tensor:
    """mask with True at each (row, column + column_offset) of pairs (2, Q)."""
    if pairs.shape[1]:
        mask = mask.index_put((pairs[0], pairs[1] + column_offset), torch.ones_like(pairs[0], dtype=torch.bool))
    return mask


def _phrase_loss(
    region: Tensor,
    phrase: Tensor,
    positive: Tensor,
    region_negatives: Tensor,
    phrase_negatives: Tensor,
    phrase_identity: Tensor,
    all_phrase: Tensor,
    all_phrase_identity: Tensor,
    phrase_offset: int,
    all_region: Tensor | None,
    all_region_identity: Tensor | None,
    region_offset: int,
    margin: float,
    top_k: int,
    lambda_image: float,
    lambda_text: float,
) -> Tensor:
    """Local anchors against the candidates: phrases of the global batch (all_phrase, this rank's
    from row phrase_offset), regions of their own image (region_negatives) and, with all_region,
    every region of the global batch (this rank's from row region_offset) of another identity."""
    anchor_region = region[positive]
    total = phrase.sum() * 0 + region.sum() * 0
    if lambda_image:
        # 3.a: every phrase of another image, and those of its own image that phrase_negatives lists
        negative = phrase_identity[:, None] != all_phrase_identity[None, :]
        negative = _scatter(negative, phrase_negatives, phrase_offset)
        total = total + lambda_image * top_k_hinge_sum(anchor_region, phrase, all_phrase, negative, margin, top_k)
    if lambda_text:
        if all_region is None:  # 3.b: the regions of its own image, each phrase's listed ones
            hinges = top_k_pair_hinge_sum(phrase, anchor_region, region, region_negatives, margin, top_k)
        else:  # "batch": and every region of another image
            negative = phrase_identity[:, None] != all_region_identity[None, :]
            negative = _scatter(negative, region_negatives, region_offset)
            hinges = top_k_hinge_sum(phrase, anchor_region, all_region, negative, margin, top_k)
        total = total + lambda_text * hinges
    return total


def _check_phrases(
    region: Tensor,
    phrase: Tensor,
    positive: Tensor,
    phrase_sample: Tensor,
    region_sample: Tensor,
    region_negatives: Tensor,
    phrase_negatives: Tensor,
    samples: int,
) -> None:
    if region.dim() != 2 or phrase.dim() != 2 or region.shape[1] != phrase.shape[1]:
        raise ValueError(
            f"region (R, D) and phrase (M, D) must be 2-D with the same D, got {tuple(region.shape)} "
            f"and {tuple(phrase.shape)}"
        )
    m, r = phrase.shape[0], region.shape[0]
    checks = [
        ("positive", positive, (m,), r),
        ("phrase_sample", phrase_sample, (m,), samples),
        ("region_sample", region_sample, (r,), samples),
    ]
    for name, value, shape, bound in checks:
        if value.shape != shape or value.dtype != torch.long:
            raise ValueError(f"{name} must be a long tensor of shape {shape}, got {value.dtype} {tuple(value.shape)}")
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= bound):
            raise ValueError(f"{name} must index {bound} rows, got values in [{int(value.min())}, {int(value.max())}]")
    for name, pairs, bound, sample in (
        ("region_negatives", region_negatives, r, region_sample),
        ("phrase_negatives", phrase_negatives, m, phrase_sample),
    ):
        if pairs.dim() != 2 or pairs.shape[0] != 2 or pairs.dtype != torch.long:
            raise ValueError(
                f"{name} must be a (2, Q) long tensor of (phrase, candidate) pairs, got {pairs.dtype} "
                f"{tuple(pairs.shape)}"
            )
        if not pairs.numel():
            continue
        if int(pairs.min()) < 0 or int(pairs[0].max()) >= m or int(pairs[1].max()) >= bound:
            raise ValueError(f"{name} must index {m} phrases and {bound} candidates")
        if bool((phrase_sample[pairs[0]] != sample[pairs[1]]).any()):
            raise ValueError(
                f"{name} pairs a phrase with a candidate of another image: it lists the negatives within "
                "an image only (those of other images are the identities')"
            )


NegativesFrom = Literal["image", "batch"]


def _sample_count(identity: Tensor | None, phrase_sample: Tensor, region_sample: Tensor) -> int:
    if identity is not None:
        return int(identity.shape[0])
    return max([int(x.max()) + 1 for x in (phrase_sample, region_sample) if x.numel()], default=0)


@in_loss_precision
def phrase_ranking_loss(
    region: Tensor,
    phrase: Tensor,
    positive: Tensor,
    phrase_sample: Tensor,
    region_sample: Tensor,
    region_negatives: Tensor,
    phrase_negatives: Tensor,
    identity: Tensor | None = None,
    margin: float = 0.1,
    top_k: int = 30,
    lambda_image: float = 1.0,
    lambda_text: float = 4.0,
    negatives_from: NegativesFrom = "image",
) -> Tensor:
    """The phrase-localisation loss of one batch in one process (module docstring; the paper's
    settings: margin 0.1, K = 30, lambdas 1 and 4).

    region (R, D), phrase (M, D): normalised embeddings. positive (M,): each phrase's positive
    region row. phrase_sample (M,), region_sample (R,): each row's sample (image), indexing
    identity (S,), the samples' image ids (default: each sample an image of its own).
    region_negatives (2, Q): (phrase, region) pairs, the regions of its own image that are
    negatives of the phrase; phrase_negatives (2, Q'): (phrase m, phrase k) pairs of one image,
    k a negative of m's positive region (collate_phrases lists both, from the boxes)."""
    return cross_rank_phrase_ranking_loss(
        region,
        phrase,
        positive,
        phrase_sample,
        region_sample,
        region_negatives,
        phrase_negatives,
        identity,
        margin,
        top_k,
        lambda_image,
        lambda_text,
        negatives_from,
        gather=False,
    )


@in_loss_precision
def cross_rank_phrase_ranking_loss(
    region: Tensor,
    phrase: Tensor,
    positive: Tensor,
    phrase_sample: Tensor,
    region_sample: Tensor,
    region_negatives: Tensor,
    phrase_negatives: Tensor,
    identity: Tensor | None = None,
    margin: float = 0.1,
    top_k: int = 30,
    lambda_image: float = 1.0,
    lambda_text: float = 4.0,
    negatives_from: NegativesFrom = "image",
    gather: bool = True,
) -> Tensor:
    """This rank's share of `phrase_ranking_loss` of the global batch: its phrases and their
    positive regions as anchors. A phrase's regions are its own image's, which travel in its
    sample, so the phrase-anchor term needs no gather ("image"); the region-anchor term ranks
    every rank's phrases (gathered with gradient), as "batch" does every rank's regions. The
    shares sum to the loss of the ranks' batches concatenated. Without `gather`, each rank's
    slice is its own batch (cheaper, and a different loss). identity: (S,) the image ids of this
    rank's samples (batch["identity"]), gathered with the rows."""
    if negatives_from not in ("image", "batch"):
        raise ValueError(f"negatives_from must be 'image' or 'batch', got {negatives_from!r}")
    device = region.device
    positive, phrase_sample, region_sample, region_negatives, phrase_negatives = (
        x.to(device) for x in (positive, phrase_sample, region_sample, region_negatives, phrase_negatives)
    )
    samples = _sample_count(identity, phrase_sample, region_sample)
    _check_phrases(region, phrase, positive, phrase_sample, region_sample, region_negatives, phrase_negatives, samples)
    single = world()[1] == 1 or not gather
    if single:
        identity = torch.arange(samples, device=device) if identity is None else identity.to(device)
    else:
        identity = local_identities(identity, samples, device)
    phrase_identity, region_identity = identity[phrase_sample], identity[region_sample]
    all_region = all_region_identity = None
    region_offset = 0
    if single:
        all_phrase, phrase_offset, all_phrase_identity = phrase, 0, phrase_identity
        if negatives_from == "batch":
            all_region, all_region_identity = region, region_identity
    else:
        all_phrase, phrase_offset = all_gather_with_grad(phrase)
        all_phrase_identity = all_gather_rows(phrase_identity)[0]
        if negatives_from == "batch":
            all_region, region_offset = all_gather_with_grad(region)
            all_region_identity = all_gather_rows(region_identity)[0]
    return _phrase_loss(
        region,
        phrase,
        positive,
        region_negatives,
        phrase_negatives,
        phrase_identity,
        all_phrase,
        all_phrase_identity,
        phrase_offset,
        all_region,
        all_region_identity,
        region_offset,
        margin,
        top_k,
        lambda_image,
        lambda_text,
    )
