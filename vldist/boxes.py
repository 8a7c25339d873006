"""Intersection over union of (x1, y1, x2, y2) boxes, in continuous coordinates.

The same arithmetic as `torchvision.ops.box_iou`, in numpy: the phrase loader and the phrase
metric compare a few boxes against an image's few dozen proposals, once per image or phrase, and
at that size box_iou's per-operator dispatch costs more than its arithmetic (0.085 ms a call for 3
boxes against 32, against 0.02 ms here; under cProfile about a seventh of the CPU a 250-image phrase
batch took to load).
tests/unit/test_boxes.py holds the two equal.
"""

from __future__ import annotations

import numpy as np


def box_iou(boxes1, boxes2) -> np.ndarray:
    """(N, 4) x (M, 4) -> (N, M) IoU in the inputs' float dtype (float32 for anything else). Two
    boxes of zero area give 0 / 0 = NaN, as torchvision's does; NaN compares False against any
    threshold."""
    a, b = _boxes(boxes1), _boxes(boxes2)
    a, b = np.asarray(a, np.result_type(a, b)), np.asarray(b, np.result_type(a, b))
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    sides = np.clip(bottom_right - top_left, 0, None)
    inter = sides[..., 0] * sides[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return inter / (area_a[:, None] + area_b[None, :] - inter)


def _boxes(boxes) -> np.ndarray:
    array = np.asarray(boxes)
    if array.dtype not in (np.float32, np.float64):
        array = array.astype(np.float32)
    return array.reshape(-1, 4)
