"""VSE++ hinge-based triplet ranking loss, with the hardest-negative (max-violation) variant.

`hardest_negative_hinge` scores rows (queries) against an arbitrary set of candidate columns, so
the distributed loss can score each rank's local rows against all-gathered global embeddings; the
loss is a sum over rows, so the per-rank losses add up to the full-batch loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vldist.losses.not_negative import same_identity
from vldist.losses.precision import in_loss_precision


def hardest_negative_hinge(
    scores: Tensor,
    positive_cols: Tensor,
    margin: float = 0.2,
    max_violation: bool = True,
    not_negative: Tensor | None = None,
) -> Tensor:
    """Sum over rows of the hinge cost of each row's negatives against its positive column.

    scores: (B_local x B_global) query-vs-candidate similarities; positive_cols: (B_local,) long,
    the column of each row's positive. With `max_violation` only the hardest negative per row
    counts (VSE++), otherwise all negatives are summed (VSE0). not_negative: optional
    (B_local x B_global) bool, pairs that are never negatives (another copy of the row's image);
    the positive itself is always excluded.
    """
    if scores.dim() != 2 or scores.size(1) == 0:
        raise ValueError(f"scores must be 2-D (B_local x B_global) with B_global >= 1, got shape {tuple(scores.shape)}")
    n_rows, n_cols = scores.shape
    if positive_cols.dim() != 1 or positive_cols.numel() != n_rows:
        raise ValueError(
            f"positive_cols must have shape ({n_rows},) to match scores "
            f"{tuple(scores.shape)}, got {tuple(positive_cols.shape)}"
        )
    if positive_cols.dtype != torch.long:
        raise TypeError(f"positive_cols must be a LongTensor, got {positive_cols.dtype}")
    if n_rows and (int(positive_cols.min()) < 0 or int(positive_cols.max()) >= n_cols):
        raise ValueError(f"positive_cols must lie in [0, {n_cols}) for scores of shape {tuple(scores.shape)}")
    if not_negative is not None and (not_negative.shape != scores.shape or not_negative.dtype != torch.bool):
        raise ValueError(
            f"not_negative must be a bool tensor of the scores' shape {tuple(scores.shape)}, got "
            f"{not_negative.dtype} {tuple(not_negative.shape)}"
        )
    positive_cols = positive_cols.to(scores.device)

    positive = scores.gather(1, positive_cols[:, None])  # (B_local, 1)
    cost = (margin + scores - positive).clamp(min=0)
    # The positive is not its own negative (its cost would be exactly `margin`).
    cols = torch.arange(n_cols, device=scores.device)
    excluded = cols[None, :] == positive_cols[:, None]
    if not_negative is not None:
        excluded = excluded | not_negative.to(scores.device)
    cost = cost.masked_fill(excluded, 0)
    if max_violation:
        cost = cost.max(dim=1).values
    return cost.sum()


@in_loss_precision
def vse_hinge_loss(
    img: Tensor, txt: Tensor, margin: float = 0.2, max_violation: bool = True, identity: Tensor | None = None
) -> Tensor:
    """VSE++ ContrastiveLoss for matched L2-normalised (B x D) embeddings; pair i = img[i], txt[i].

    Sum of the image-as-query term (negatives are captions) and the caption-as-query term
    (negatives are images). identity: optional (B,) image ids; pairs of one image are never
    negatives (a batch drawn with replacement can hold an image twice).
    """
    if img.dim() != 2 or txt.dim() != 2:
        raise ValueError(f"img and txt must be 2-D (B x D), got {tuple(img.shape)} and {tuple(txt.shape)}")
    if img.shape != txt.shape:
        raise ValueError(f"img and txt must have the same (B x D) shape, got {tuple(img.shape)} and {tuple(txt.shape)}")
    scores = img @ txt.t()
    diag = torch.arange(img.size(0), device=img.device)
    same = same_identity(identity, identity) if identity is not None else None
    return hardest_negative_hinge(scores, diag, margin, max_violation, same) + hardest_negative_hinge(
        scores.t(), diag, margin, max_violation, same
    )
