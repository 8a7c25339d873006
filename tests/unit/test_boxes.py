"""vldist/boxes.py's IoU equals torchvision's box_iou, value for value (NaN where both boxes have
zero area), in float32 and float64."""

import numpy as np
import pytest
import torch
from torchvision.ops import box_iou as torchvision_box_iou

from vldist.boxes import box_iou


def _boxes(rng, n, dtype):
    corner = rng.integers(0, 20, (n, 2)).astype(dtype)  # integers: touching and identical boxes occur
    size = rng.integers(0, 8, (n, 2)).astype(dtype)  # zero widths and heights too
    return np.concatenate([corner, corner + size], 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_box_iou_equals_torchvision(dtype):
    rng = np.random.default_rng(0)
    a, b = _boxes(rng, 40, dtype), _boxes(rng, 60, dtype)
    a[:3] += rng.random((3, 4)).astype(dtype)  # and some fractional corners
    b[:5] = a[:5]  # identical boxes
    ours = box_iou(a, b)
    theirs = torchvision_box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    assert ours.dtype == dtype and ours.shape == (40, 60)
    assert np.isnan(theirs).any() and (theirs == 1).any() and (theirs == 0).any()  # the edge cases occur
    assert np.array_equal(ours, theirs, equal_nan=True)


def test_box_iou_of_integer_boxes_is_float32_and_of_lists_float64():
    assert box_iou(np.array([[0, 0, 2, 2]]), np.array([[1, 1, 3, 3]])).dtype == np.float32
    iou = box_iou([[0.0, 0.0, 2.0, 2.0]], [[1.0, 1.0, 3.0, 3.0], [0.0, 0.0, 2.0, 2.0]])
    assert iou.dtype == np.float64 and iou.tolist() == [[1 / 7, 1.0]]
