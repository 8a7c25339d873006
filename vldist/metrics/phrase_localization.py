"""Phrase localisation recall (two-branch networks, Wang, Li & Lazebnik, TPAMI; Flickr30K Entities,
Plummer et al.): does a phrase's best-scoring region proposals cover its ground-truth box?

Each phrase (the query) comes with its image's region proposals and a score per proposal (higher is
better). A proposal *covers* the phrase when its IoU with the phrase's ground-truth box is >= `iou`
(0.5 in the papers). R@K is the percentage of phrases with at least one covering proposal among
their top K proposals. Phrases that no proposal covers can never be hit but stay in the denominator,
so R@K is bounded by `upper_bound`, the percentage of phrases covered by any proposal at all (what
the papers report as the proposals' upper bound).

Ties are broken against the query, as in `vldist.metrics.retrieval`: a non-covering proposal that
scores *equal* to the best covering one is ranked ahead of it, so a model that scores every
proposal alike gets the worst rank, not the best. A covering proposal tied with the best covering
one is not counted against it: whichever of the two is listed first, the top K holds a covering
proposal. The rank is therefore 1 + the number of non-covering proposals scoring >= the best
covering proposal's score.

Boxes are [x0, y0, x1, y1] in pixels, taken as continuous coordinates (area (x1-x0)*(y1-y0), no +1,
as `torchvision.ops.box_iou` computes it; vldist/boxes.py).
"""

from __future__ import annotations

import numbers

import numpy as np

from vldist.boxes import box_iou
from vldist.metrics.ks import check_ks
from vldist.metrics.numpy_input import to_numpy

PHRASE_LOCALIZATION_KS = (1, 5, 10)


def _float64(x, what: str, expected: str) -> np.ndarray:
    """`x` (tensor of any dtype incl. bf16, array, or nested list) as a float64 numpy array."""
    if hasattr(x, "detach"):  # torch tensor
        x = to_numpy(x, float64=True)
    elif isinstance(x, (list, tuple)) and any(hasattr(e, "detach") for e in x):
        x = [_float64(e, what, expected) for e in x]  # a list of per-phrase tensors
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:  # ragged lists, strings, ...
        raise ValueError(f"{what} must be {expected}; it could not be read as a float array: {err}") from None


def _check_boxes(boxes: np.ndarray, what: str, expected: str) -> np.ndarray:
    """(P, 4) finite boxes with x1 >= x0 and y1 >= y0, else a ValueError naming the first bad box."""
    if boxes.ndim == 1 and boxes.size == 0:
        boxes = boxes.reshape(0, 4)  # np.asarray([]) is (0,): no proposals
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{what} must have shape {expected} ([x0, y0, x1, y1] per box), got shape {boxes.shape}")
    bad = np.flatnonzero(~np.isfinite(boxes).all(axis=1))
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] = {boxes[bad[0]].tolist()} is not finite ({bad.size} bad box(es))")
    bad = np.flatnonzero((boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1]))
    if bad.size:
        raise ValueError(
            f"{what}[{bad[0]}] = {boxes[bad[0]].tolist()} has x1 < x0 or y1 < y0: boxes "
            f"are [x0, y0, x1, y1] with x1 >= x0 and y1 >= y0 ({bad.size} bad box(es))"
        )
    return boxes


def _check_iou(iou) -> float:
    # bool is a numbers.Real too, and True would silently mean 1.0.
    if isinstance(iou, bool) or not isinstance(iou, numbers.Real) or not 0.0 < float(iou) <= 1.0:
        raise ValueError(f"iou must be a number in (0, 1], got {iou!r}")
    return float(iou)


def _per_phrase(scores, proposal_boxes) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Scores (P_i,) and checked boxes (P_i, 4) of every phrase, from the list or the padded form."""
    if getattr(scores, "ndim", None) == 2:
        # Padded form: (n_phrases, P) scores with (n_phrases, P, 4) boxes. Every one of the P columns
        # is a proposal; phrases with different proposal counts need the list form.
        scores = _float64(scores, "scores", "a 2-D (n_phrases, P) array")
        n, p = scores.shape
        expected = f"(n_phrases, P, 4) = ({n}, {p}, 4) to match 2-D scores of shape {scores.shape}"
        boxes = _float64(proposal_boxes, "proposal_boxes", expected)
        if boxes.shape != (n, p, 4):
            raise ValueError(f"proposal_boxes must have shape {expected}, got shape {boxes.shape}")
        scores, boxes = list(scores), list(boxes)
    elif getattr(scores, "ndim", 1) != 1 or isinstance(scores, (str, bytes)):
        raise ValueError(
            f"scores must be a list of 1-D arrays (one per phrase, scoring its proposals) or a 2-D "
            f"(n_phrases, P) array; got shape {getattr(scores, 'shape', None)}"
        )
    else:
        scores = list(scores)
        if getattr(scores[0] if scores else None, "ndim", 1) == 0:
            # A 1-D array of floats is one score per phrase, not one per proposal.
            raise ValueError(
                "scores must be a list of 1-D arrays (one per phrase, scoring its "
                "proposals) or a 2-D (n_phrases, P) array; got a 1-D array of scalars"
            )
        boxes = list(proposal_boxes)
        if len(boxes) != len(scores):
            raise ValueError(
                f"proposal_boxes has {len(boxes)} entries but scores has {len(scores)}; "
                f"expected one (P_i, 4) array of boxes per phrase, aligned with scores"
            )
    out_scores, out_boxes = [], []
    for i, (s, b) in enumerate(zip(scores, boxes, strict=True)):
        s = _float64(s, f"scores[{i}]", "a 1-D array of proposal scores")
        if s.ndim != 1:
            raise ValueError(f"scores[{i}] must be 1-D (one score per proposal of phrase {i}), got shape {s.shape}")
        if np.isnan(s).any():
            raise ValueError(
                f"scores[{i}] contains NaN (phrase {i}); scores must be comparable numbers (+-inf allowed)"
            )
        expected = f"(P_i, 4) = ({s.shape[0]}, 4) to match scores[{i}]"
        out_boxes.append(_check_boxes(_float64(b, f"proposal_boxes[{i}]", expected), f"proposal_boxes[{i}]", expected))
        if out_boxes[-1].shape[0] != s.shape[0]:
            raise ValueError(f"proposal_boxes[{i}] must have shape {expected}, got shape {out_boxes[-1].shape}")
        out_scores.append(s)
    return out_scores, out_boxes


def phrase_localization_ranks(scores, proposal_boxes, gt_boxes, iou=0.5) -> np.ndarray:
    """Per phrase, the 1-based rank of its best covering proposal (pessimistic ties); inf where no
    proposal covers the phrase. Arguments as in `phrase_localization_recall`."""
    iou = _check_iou(iou)
    scores, boxes = _per_phrase(scores, proposal_boxes)
    n = len(scores)
    if n == 0:
        raise ValueError("no phrases: scores, proposal_boxes and gt_boxes are empty; expected n_phrases >= 1")
    gt_expected = f"(n_phrases, 4) = ({n}, 4), one ground-truth box per phrase"
    gt = _float64(gt_boxes, "gt_boxes", gt_expected)
    if gt.ndim != 2 or gt.shape[0] != n:
        raise ValueError(f"gt_boxes must have shape {gt_expected}, got shape {gt.shape}")
    gt = _check_boxes(gt, "gt_boxes", gt_expected)

    ranks = np.full(n, np.inf)
    for i, (s, b) in enumerate(zip(scores, boxes, strict=True)):
        if s.shape[0] == 0:
            continue  # no proposals: uncovered
        # float64 IoU so that an overlap exactly at the threshold is not lost to rounding. Two
        # zero-area boxes give 0/0 = NaN, which compares False: not covering.
        overlap = box_iou(gt[i : i + 1], b)[0]
        covering = overlap >= iou
        if not covering.any():
            continue
        best = s[covering].max()
        # Non-covering proposals scoring >= the best covering one are ranked ahead of it. The rank
        # never exceeds P_i, so a k above P_i is capped at P_i without further ado.
        ranks[i] = 1 + np.count_nonzero((s >= best) & ~covering)
    return ranks


def phrase_localization_recall(scores, proposal_boxes, gt_boxes, ks=(1, 5, 10), iou=0.5) -> dict:
    """{"r{k}": percent of phrases with a covering proposal in their top k, ..., "upper_bound":
    percent of phrases covered by any proposal, "n_phrases": n}.

    scores: one entry per phrase, a 1-D array/tensor scoring that phrase's image's P_i proposals
        (higher is better; P_i may differ between phrases and may be 0) -- or, padded form, one 2-D
        (n_phrases, P) array/tensor.
    proposal_boxes: per phrase, a (P_i, 4) array/tensor aligned with scores[i] -- or, with 2-D
        scores, one (n_phrases, P, 4) array/tensor.
    gt_boxes: (n_phrases, 4) array/tensor or list of 4-lists, the phrase's ground-truth box.
    Boxes are [x0, y0, x1, y1] pixels. Tensors may be of any float dtype (bf16 included).
    A proposal covers a phrase when its IoU with the ground truth is >= iou, iou in (0, 1].
    """
    ks = check_ks(ks)
    ranks = phrase_localization_ranks(scores, proposal_boxes, gt_boxes, iou)
    out: dict = {f"r{k}": float(100.0 * np.mean(ranks <= k)) for k in ks}
    out["upper_bound"] = float(100.0 * np.mean(np.isfinite(ranks)))
    out["n_phrases"] = int(ranks.shape[0])
    return out
