"""Losses over the global batch when each rank holds a slice of it.

Convention: a recipe returns its rank's *share* of the global loss, so that the shares summed over
ranks equal the loss one process would compute on the whole global batch. The engine multiplies by
the world size before backward, because DDP and DeepSpeed average gradients over ranks.

Hard negatives are exact: embeddings are all-gathered with gradient (open_clip's
`gather_with_grad`), each rank scores its local rows against the global batch (`local_loss`), and
gradients flow back to the rank that produced each embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vldist.distributed.collectives import all_gather_with_grad, global_sum, world
from vldist.losses.hinge import hardest_negative_hinge, vse_hinge_loss
from vldist.losses.not_negative import gather_identities, same_identity
from vldist.losses.precision import in_loss_precision


@in_loss_precision
def cross_rank_vse_hinge_loss(
    img: Tensor,
    txt: Tensor,
    margin: float = 0.2,
    max_violation: bool = True,
    gather: bool = True,
    identity: Tensor | None = None,
) -> Tensor:
    """This rank's share of the VSE++ hinge loss of the global batch.

    With gather, local images are ranked against every caption of the global batch and local
    captions against every image, so the hardest negative is the global one: the shares sum to
    `vse_hinge_loss` of the concatenated batch. Without gather, negatives come from the local
    slice only (cheaper, and a different loss). Memory: gathering holds the global batch's
    embeddings (B x D per modality) and a (B/W x B) score matrix per direction on every rank,
    instead of (B/W x D) and (B/W x B/W). identity: optional (B_local,) image ids of the rows
    (batch["identity"]), gathered too: pairs of one image are never negatives.
    """
    if world()[1] == 1 or not gather:
        return vse_hinge_loss(img, txt, margin, max_violation, identity)
    (all_img, offset), (all_txt, _) = all_gather_with_grad(img), all_gather_with_grad(txt)
    mine, everyone = gather_identities(identity, img.shape[0], img.device)
    same = same_identity(mine, everyone)
    positives = torch.arange(img.shape[0], device=img.device) + offset
    return hardest_negative_hinge(img @ all_txt.T, positives, margin, max_violation, same) + hardest_negative_hinge(
        txt @ all_img.T, positives, margin, max_violation, same
    )


def cross_rank_token_nll(logits: Tensor, targets: Tensor, pad_id: int = 0) -> Tensor:
    """This rank's share of the mean per-token NLL over the global batch's real tokens.

    Keeps a captioning loss on the scale of one word whatever the caption length. Ranks hold
    different numbers of real tokens, so each divides its sum by the global count: the shares then
    sum to the mean one process would compute over the whole batch.
    """
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=pad_id, reduction="sum")
    count = global_sum((targets != pad_id).sum().to(total.dtype))
    return total / count.clamp(min=1)


def cross_rank_caption_nll(logits: Tensor, targets: Tensor, pad_id: int = 0) -> Tensor:
    """This rank's share of the NLL summed over each caption's real tokens and averaged over the
    global batch's captions.

    VSRN's L_G (Eq. 9) as its official code weighs it: `LanguageModelCriterion` (from the
    video-caption code VSRN builds on) returns sum(token NLL x mask) / batch size, a per-caption
    sum, about as many times larger than a per-token mean as a caption has words (12 on COCO).
    Each rank divides its sum by the global number of captions, so the shares sum to the value
    of one process on the whole batch.
    """
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=pad_id, reduction="sum")
    count = global_sum(torch.tensor(float(targets.shape[0]), device=total.device, dtype=total.dtype))
    return total / count.clamp(min=1)


def cross_rank_mean(local_mean: Tensor, local_count: int) -> Tensor:
    """This rank's share of a per-sample mean over the global batch, from its mean over its own
    `local_count` samples: the shares sum to the mean one process computes over all of them.
    (Returning the local mean itself would count the term W times on W ranks.)"""
    count = global_sum(torch.tensor(float(local_count), device=local_mean.device))
    return local_mean * (local_count / count.clamp(min=1))
