"""Phrase localisation samples: each object phrase of an image is a query whose answer is a box.

A sample's JSON lists `objects` (each with a `phrase`, its ground-truth `box`, optionally
`region`, its row in regions.npy, and `entity`, its coreference chain: Flickr30K Entities' EN# id,
shared by the phrases of the image's captions that name one thing) and `proposal_boxes`, whose
features are proposals.npy (shards/README.md). Training rows follow the two-branch paper (§4.1,
Algorithm 1): a phrase's positive regions overlap its box with IoU >= 0.7, its negatives are
regions of the same image with IoU < 0.3 with its box, and the phrases of one chain are never each
other's negatives. "Augmented positives" take a random positive proposal at each visit instead of
the ground-truth box's own region.
"""

from __future__ import annotations

import random

import numpy as np

from vldist.boxes import box_iou
from vldist.data.samples import load_npy

POSITIVE_IOU = 0.7
NEGATIVE_IOU = 0.3


def read_proposals(raw: dict, meta: dict, feature_dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(features (P, F), boxes (P, 4)) of the sample's proposals; ValueError naming the sample when
    they are missing or disagree (the pipeline then skips and counts it)."""
    key = raw["__key__"]
    if "proposals.npy" not in raw or "proposal_boxes" not in meta:
        raise ValueError(f"sample {key} has no proposals (proposals.npy and proposal_boxes)")
    features = load_npy(raw["proposals.npy"])
    boxes = np.asarray(meta["proposal_boxes"], dtype=np.float32).reshape(-1, 4)
    if features.ndim != 2 or features.shape[0] != boxes.shape[0] or features.shape[0] == 0:
        raise ValueError(
            f"proposals.npy of {key} has shape {features.shape}, expected ({len(boxes)}, F): one row per proposal box"
        )
    if feature_dim is not None and features.shape[1] != feature_dim:
        raise ValueError(f"proposals.npy of {key} has {features.shape[1]} features, expected {feature_dim}")
    if not np.isfinite(features).all():
        raise ValueError(f"proposals.npy of {key} holds NaN or inf")
    return features, boxes


def phrase_objects(meta: dict) -> list[dict]:
    """The objects that are queries: a phrase and a box."""
    return [o for o in meta.get("objects", []) if o.get("phrase") and o.get("box")]


def overlaps(gt_boxes, proposal_boxes) -> np.ndarray:
    """(objects x proposals) IoU in float32 (vldist/boxes.py: torchvision's box_iou arithmetic)."""
    return box_iou(np.asarray(gt_boxes, dtype=np.float32), np.asarray(proposal_boxes, dtype=np.float32))


def chains(objects: list[dict]) -> list[int]:
    """Each object's coreference chain in its image, numbered in order of first appearance: the
    objects of one `entity` share a chain; an object without an `entity` (synth scenes: one
    phrase per object) is a chain of its own."""
    numbers: dict[tuple, int] = {}
    return [
        numbers.setdefault(("entity", str(o["entity"])) if o.get("entity") is not None else ("object", i), len(numbers))
        for i, o in enumerate(objects)
    ]


def training_image(
    meta: dict,
    regions: np.ndarray,
    proposals: np.ndarray,
    proposal_boxes: np.ndarray,
    rng: random.Random,
    augmented: bool,
    negatives: int | str,
    every_positive: bool = False,
) -> dict:
    """One image's training rows for phrase localisation (the paper's Algorithm 1):

    phrases           the M phrases that have a positive, in object order (str)
    entity            (M,) each one's coreference chain in the image (`chains`)
    box               (M, 4) their ground-truth boxes
    positive          (M, F) each one's positive region: a random proposal of IoU >= 0.7 with its box
                      (augmented), else the box's own region row (else, or when no proposal
                      overlaps that much, the best proposal of IoU >= 0.7; a phrase with neither is
                      left out); positive_box (M, 4) its box
    negatives         (N, F) the image's negative pool: every proposal drawn as a negative of one
                      of its phrases, in proposal order; negative_box (N, 4)
    drawn             (D, 2) (phrase, pool row) pairs: the `negatives` proposals drawn for each
                      phrase among its own negatives ("all": every one of them)
    region_negatives  (Q, 2) (phrase, pool row) pairs: every pool row that is a negative of the
                      phrase, drawn for it or for another phrase of the image
    phrase_negatives  (Q', 2) (phrase m, phrase k) pairs of the image: k is a negative of m's
                      positive region

    `every_positive` (with `augmented`; the similarity network's rule in Algorithm 1): every
    proposal of IoU >= 0.7 is a positive pair of its own, so a phrase appears once per positive
    proposal (same chain), each time with its own draw of `negatives`.

    A proposal is a negative of a phrase when its IoU with the box of every object of the phrase's
    chain is < 0.3: with its own box (Algorithm 1, 3.b), and never one that is a positive of
    another phrase of its chain. Phrase k is a negative of phrase m's positive region x when k is
    of another chain and x is no positive of k (IoU with k's box < 0.7): the paper's "not in the
    same coreference chain (i.e., phrases y and y' are not both associated with the same ground
    truth region)" (3.a), which also keeps apart two entities annotated with one box. Regions and
    phrases of other images are the loss's business (losses/two_branch.py).
    """
    objects = phrase_objects(meta)
    dim = proposals.shape[1]
    chain = np.asarray(chains(objects), dtype=np.int64)
    iou = overlaps([o["box"] for o in objects], proposal_boxes) if objects else np.zeros((0, len(proposal_boxes)))
    # (objects x proposals): IoU < 0.3 with the box of every object of the object's chain
    near = iou >= NEGATIVE_IOU
    negative = ~np.stack([near[chain == c].any(0) for c in chain]) if objects else near
    kept, positives, positive_boxes, draws = [], [], [], []
    for index, (obj, row) in enumerate(zip(objects, iou, strict=True)):
        candidates = np.flatnonzero(row >= POSITIVE_IOU).tolist()
        region = obj.get("region")
        if augmented and candidates:
            chosen = candidates if every_positive else [rng.choice(candidates)]
            pairs = [(proposals[c], proposal_boxes[c]) for c in chosen]
        elif region is not None and 0 <= region < len(regions):
            pairs = [(regions[region], obj["box"])]
        elif candidates:
            best = max(candidates, key=lambda i: row[i])
            pairs = [(proposals[best], proposal_boxes[best])]
        else:
            continue
        own = np.flatnonzero(negative[index]).tolist()
        for positive, positive_box in pairs:
            draws.append(own if negatives == "all" else rng.sample(own, min(negatives, len(own))))
            kept.append(index)
            positives.append(positive)
            positive_boxes.append(positive_box)
    pool = sorted({p for drawn in draws for p in drawn})
    at = {p: n for n, p in enumerate(pool)}
    kept_boxes = np.asarray([objects[i]["box"] for i in kept], dtype=np.float32).reshape(-1, 4)
    positive_boxes = np.asarray(positive_boxes, dtype=np.float32).reshape(-1, 4)
    # phrase k is no negative of phrase m's positive region x: one chain, or x a positive of k
    covers = overlaps(positive_boxes, kept_boxes) >= POSITIVE_IOU if kept else np.zeros((0, 0), bool)
    same_chain = chain[kept][:, None] == chain[kept][None, :]
    return {
        "phrases": [objects[i]["phrase"] for i in kept],
        "entity": chain[kept],
        "box": kept_boxes,
        "positive": np.stack(positives) if kept else np.zeros((0, dim), proposals.dtype),
        "positive_box": positive_boxes,
        "negatives": proposals[pool] if pool else np.zeros((0, dim), proposals.dtype),
        "negative_box": np.asarray(proposal_boxes, dtype=np.float32)[pool].reshape(-1, 4),
        "drawn": _pairs([(m, at[p]) for m, drawn in enumerate(draws) for p in drawn]),
        "region_negatives": _pairs(
            np.argwhere(negative[np.ix_(np.asarray(kept, dtype=np.int64), np.asarray(pool, dtype=np.int64))])
        ),
        "phrase_negatives": _pairs(np.argwhere(~same_chain & ~covers).tolist()),
    }


def _pairs(pairs: list) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


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
