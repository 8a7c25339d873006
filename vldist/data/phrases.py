"""Phrase localisation samples: each object phrase of an image is a query whose answer is a box.

A sample's JSON lists `objects` (each with a `phrase`, its ground-truth `box` and optionally
`region`, its row in regions.npy) and `proposal_boxes`, whose features are proposals.npy
(shards/README.md). Training pairs follow the two-branch paper (§4): positive regions overlap the
phrase's box with IoU >= 0.7, negatives come from the same image with IoU < 0.3 to every object
of it (so a negative of one phrase is never a positive of another); "augmented positives" take a
random positive proposal at each visit instead of the ground-truth box's own region.
"""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from torchvision.ops import box_iou

POSITIVE_IOU = 0.7
NEGATIVE_IOU = 0.3


def read_proposals(raw: dict, meta: dict, feature_dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(features (P, F), boxes (P, 4)) of the sample's proposals; ValueError naming the sample when
    they are missing or disagree (the pipeline then skips and counts it)."""
    key = raw["__key__"]
    if "proposals.npy" not in raw or "proposal_boxes" not in meta:
        raise ValueError(f"sample {key} has no proposals (proposals.npy and proposal_boxes)")
    features = np.load(io.BytesIO(raw["proposals.npy"]), allow_pickle=False)
    boxes = np.asarray(meta["proposal_boxes"], dtype=np.float32).reshape(-1, 4)
    if features.ndim != 2 or features.shape[0] != boxes.shape[0] or features.shape[0] == 0:
        raise ValueError(f"proposals.npy of {key} has shape {features.shape}, expected ({len(boxes)}, F): one row "
                         "per proposal box")
    if feature_dim is not None and features.shape[1] != feature_dim:
        raise ValueError(f"proposals.npy of {key} has {features.shape[1]} features, expected {feature_dim}")
    if not np.isfinite(features).all():
        raise ValueError(f"proposals.npy of {key} holds NaN or inf")
    return features, boxes


def phrase_objects(meta: dict) -> list[dict]:
    """The objects that are queries: a phrase and a box."""
    return [o for o in meta.get("objects", []) if o.get("phrase") and o.get("box")]


def overlaps(gt_boxes, proposal_boxes) -> np.ndarray:
    """(objects x proposals) IoU (torchvision's box_iou, continuous pixel coordinates)."""
    gt = torch.as_tensor(np.asarray(gt_boxes, dtype=np.float32).reshape(-1, 4))
    return box_iou(gt, torch.as_tensor(proposal_boxes, dtype=torch.float32)).numpy()


def training_pairs(meta: dict, regions: np.ndarray, proposals: np.ndarray, proposal_boxes: np.ndarray,
                   rng: random.Random, augmented: bool, negatives: int) -> list[dict]:
    """For each phrase of the image: {"phrase", "positive": (F,), "negatives": (k, F)}, k <= negatives.

    The positive is a random proposal of IoU >= 0.7 (augmented) or the ground-truth box's own
    region row (else, or when no proposal overlaps that much; a phrase with neither is left out).
    """
    objects = phrase_objects(meta)
    if not objects:
        return []
    iou = overlaps([o["box"] for o in objects], proposal_boxes)
    free = np.flatnonzero(iou.max(0) < NEGATIVE_IOU).tolist()
    pairs = []
    for obj, row in zip(objects, iou):
        candidates = np.flatnonzero(row >= POSITIVE_IOU).tolist()
        region = obj.get("region")
        if augmented and candidates:
            positive = proposals[rng.choice(candidates)]
        elif region is not None and 0 <= region < len(regions):
            positive = regions[region]
        elif candidates:
            positive = proposals[max(candidates, key=lambda i: row[i])]
        else:
            continue
        chosen = rng.sample(free, min(negatives, len(free)))
        pairs.append({"phrase": obj["phrase"], "positive": positive, "negatives": proposals[chosen]})
    return pairs


def random_ranking_recall(iou_rows: list[np.ndarray], k: int, threshold: float = 0.5) -> float:
    """Expected R@k (percent) of a random order of each phrase's proposals: 1 - C(P - c, k) / C(P, k)
    with c covering proposals of P, averaged over phrases (uncovered phrases count as misses)."""
    from math import comb

    rates = []
    for row in iou_rows:
        p, c = len(row), int((row >= threshold).sum())
        top = min(k, p)
        rates.append(1 - comb(p - c, top) / comb(p, top) if p else 0.0)
    return 100 * float(np.mean(rates)) if rates else 0.0
