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
"""

from __future__ import annotations

import torch
from torch import Tensor

from vldist.distributed.collectives import all_gather_rows, all_gather_with_grad, world
from vldist.losses.not_negative import gather_identities

# Inside the square root: the distance's gradient at d = 0 would be infinite (the official code
# adds 1e-4; this is smaller so that d stays within 1e-4 of the true distance).
_EPS = 1e-8


def euclidean(a: Tensor, b: Tensor) -> Tensor:
    """(A, D) x (B, D) -> (A, B) Euclidean distances, differentiable everywhere."""
    squared = (a * a).sum(1, keepdim=True) + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return (squared.clamp(min=0) + _EPS).sqrt()


def top_k_hinge_sum(anchor: Tensor, positive: Tensor, candidates: Tensor, negative: Tensor, margin: float,
                    top_k: int) -> Tensor:
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


def _ranking_loss(image: Tensor, text: Tensor, text_image: Tensor, all_image: Tensor, all_text: Tensor,
                  all_text_image: Tensor, all_identity: Tensor, image_offset: int, margin: float, top_k: int,
                  lambda_image: float, lambda_text: float, lambda_text_neighbors: float) -> Tensor:
    """Local anchors (image, text; text_image indexes `image`) against global candidates (all_*;
    all_text_image indexes `all_image`; this rank's images start at row `image_offset`).
    all_identity: each global image row's identity; rows of one identity are one image, never
    each other's negatives (a batch drawn with replacement can hold an image twice)."""
    own = text_image + image_offset  # each local sentence's image, as a global row
    own_identity = all_identity[own]
    other_image_text = own_identity[:, None] != all_identity[all_text_image][None, :]  # (M_local, M_global)
    total = image.sum() * 0
    if lambda_image:
        total = total + lambda_image * top_k_hinge_sum(
            all_image[own], text, all_text, other_image_text, margin, top_k)
    if lambda_text:
        total = total + lambda_text * top_k_hinge_sum(
            text, all_image[own], all_image, own_identity[:, None] != all_identity[None, :], margin, top_k)
    if lambda_text_neighbors:
        # (anchor, positive): every ordered pair of distinct sentences of one sample. The sentences
        # of a sample travel together, so a local anchor's neighbours are local too.
        same = text_image[:, None] == text_image[None, :]
        same.fill_diagonal_(False)
        anchors, positives = same.nonzero(as_tuple=True)
        total = total + lambda_text_neighbors * top_k_hinge_sum(
            text[anchors], text[positives], all_text, other_image_text[anchors], margin, top_k)
    return total


def _check(image: Tensor, text: Tensor, text_image: Tensor) -> None:
    if image.dim() != 2 or text.dim() != 2 or image.shape[1] != text.shape[1]:
        raise ValueError(f"image (N, D) and text (M, D) must be 2-D with the same D, got {tuple(image.shape)} "
                         f"and {tuple(text.shape)}")
    if text_image.shape != (text.shape[0],) or text_image.dtype != torch.long:
        raise ValueError(f"text_image must be a long tensor of shape ({text.shape[0]},), the image row of each "
                         f"sentence; got {text_image.dtype} {tuple(text_image.shape)}")
    if text_image.numel() and (int(text_image.min()) < 0 or int(text_image.max()) >= image.shape[0]):
        raise ValueError(f"text_image must index the {image.shape[0]} image rows, got values in "
                         f"[{int(text_image.min())}, {int(text_image.max())}]")


def two_branch_ranking_loss(image: Tensor, text: Tensor, text_image: Tensor, margin: float = 0.1,
                            top_k: int = 50, lambda_image: float = 1.0, lambda_text: float = 2.0,
                            lambda_text_neighbors: float = 0.0, identity: Tensor | None = None) -> Tensor:
    """The loss of one batch in one process: `image` (N, D) and `text` (M, D) normalised
    embeddings, `text_image` (M,) the image row of each sentence, `identity` (N,) optional image
    ids (rows of one id are never each other's negatives). Returns the weighted sum of the three
    terms' top-K hinges (module docstring)."""
    _check(image, text, text_image)
    identity = torch.arange(image.shape[0], device=image.device) if identity is None else identity.to(image.device)
    return _ranking_loss(image, text, text_image, image, text, text_image, identity, 0, margin, top_k,
                         lambda_image, lambda_text, lambda_text_neighbors)


def cross_rank_two_branch_ranking_loss(image: Tensor, text: Tensor, text_image: Tensor, margin: float = 0.1,
                                       top_k: int = 50, lambda_image: float = 1.0, lambda_text: float = 2.0,
                                       lambda_text_neighbors: float = 0.0, gather: bool = True,
                                       identity: Tensor | None = None) -> Tensor:
    """This rank's share of `two_branch_ranking_loss` of the global batch: its anchors, with the
    top-K violators chosen among every rank's images and sentences (gathered with gradient). The
    shares sum to the loss of the ranks' batches concatenated. Without `gather`, each rank's slice
    is its own batch (cheaper, and a different loss). identity: (N,) image ids of this rank's
    image rows (batch["identity"]), gathered with them."""
    _check(image, text, text_image)
    if world()[1] == 1 or not gather:
        return two_branch_ranking_loss(image, text, text_image, margin, top_k, lambda_image, lambda_text,
                                       lambda_text_neighbors, identity)
    all_image, image_offset = all_gather_with_grad(image)
    all_text, _ = all_gather_with_grad(text)
    all_text_image = all_gather_rows(text_image + image_offset)[0]  # global image rows
    all_identity = gather_identities(identity, image.shape[0], image.device)[1]
    return _ranking_loss(image, text, text_image, all_image, all_text, all_text_image, all_identity, image_offset,
                         margin, top_k, lambda_image, lambda_text, lambda_text_neighbors)
