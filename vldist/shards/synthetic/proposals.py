"""Candidate boxes ("proposals") for phrase localisation, without a detector.

The two-branch paper ranks 200 EdgeBox proposals per image; EdgeBoxes needs a trained edge model
that cannot be downloaded here. These proposals are built to give the task the same structure:
for each object, jittered copies of its box at a range of overlaps (some IoU >= 0.7 positives,
some in between, some < 0.3 negatives), then the whole image and a grid of cells, then random
boxes, in that order up to `count`, all decided by `rng`. Converters of real sets without their
own proposals use the same generator around their annotated boxes.
"""

from __future__ import annotations

import random

# Jitter sizes relative to the object's side: small ones keep IoU high (positives), large ones
# mostly give partial overlaps and misses.
JITTERS = (0.05, 0.15, 0.25, 0.35, 0.5)
GRIDS = (2,)  # cells per side of the grid boxes (with the whole image: 5 boxes)


def _clip(box, width: int, height: int) -> list[int] | None:
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    x0, y0, x1, y1 = max(0, x0), max(0, y0), min(width, x1), min(height, y1)
    return [x0, y0, x1, y1] if x1 - x0 >= 2 and y1 - y0 >= 2 else None


def _jittered(box, scale: float, rng: random.Random, width: int, height: int) -> list[int] | None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    dx0, dx1 = (rng.uniform(-scale, scale) * w for _ in range(2))
    dy0, dy1 = (rng.uniform(-scale, scale) * h for _ in range(2))
    return _clip([x0 + dx0, y0 + dy0, x1 + dx1, y1 + dy1], width, height)


def make_proposals(
    width: int,
    height: int,
    object_boxes: list[list[int]],
    count: int,
    rng: random.Random,
    jitters: tuple[float, ...] = JITTERS,
    scale_first: bool = False,
) -> list[list[int]]:
    """`count` distinct pixel boxes [x0, y0, x1, y1]: per object one jitter of each size in
    `jitters`, then the whole image and the grid cells, then random boxes. With many objects the
    jitters alone may exceed `count`: they are cut, the first objects keeping theirs; or, with
    `scale_first`, the loosest jitters (one scale at a time over all objects, so that every object
    gets its tightest before any gets a looser one)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    boxes: list[list[int]] = []

    def add(box) -> None:
        if box is not None and box not in boxes and len(boxes) < count:
            boxes.append(box)

    pairs = (
        [(box, scale) for scale in jitters for box in object_boxes]
        if scale_first
        else [(box, scale) for box in object_boxes for scale in jitters]
    )
    for box, scale in pairs:
        add(_jittered(box, scale, rng, width, height))
    add([0, 0, width, height])
    for cells in GRIDS:
        for row in range(cells):
            for col in range(cells):
                add(
                    _clip(
                        [
                            col * width / cells,
                            row * height / cells,
                            (col + 1) * width / cells,
                            (row + 1) * height / cells,
                        ],
                        width,
                        height,
                    )
                )
    for _attempt in range(100 * count):  # random boxes of at least 1/8 of each side
        if len(boxes) == count:
            break
        w, h = rng.uniform(width / 8, width), rng.uniform(height / 8, height)
        x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
        add(_clip([x0, y0, x0 + w, y0 + h], width, height))
    return boxes
