"""L2C's pictures with each evaluation: each pair's images, their predicted foreground masks and
the semantic classes of their confidence maps."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vldist.data.pictures import to_pil

# one clearly distinct colour per semantic class (K <= 12 gets its own, more repeat)
PALETTE = np.array(
    [
        (230, 25, 75),
        (60, 180, 75),
        (0, 130, 200),
        (255, 225, 25),
        (145, 30, 180),
        (245, 130, 48),
        (70, 240, 240),
        (240, 50, 230),
        (128, 128, 0),
        (0, 128, 128),
        (170, 110, 40),
        (128, 0, 0),
    ],
    dtype=np.uint8,
)


def mask_picture(mask: torch.Tensor, size: int) -> Image.Image:
    """A (1, h, w) mask in [0, 1] as a grey picture of `size` pixels (nearest: one block per cell)."""
    grey = (mask.detach().float().cpu()[0].clamp(0, 1).numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(grey, "L").resize((size, size), Image.NEAREST).convert("RGB")


def class_picture(confidence: torch.Tensor, mask: torch.Tensor, size: int) -> Image.Image:
    """Each cell coloured by its most likely class of the (K, h, w) confidence maps, dimmed where
    the mask says background (Eq. 1 pools only the masked cells)."""
    classes = confidence.detach().float().cpu().argmax(dim=0).numpy()
    colours = PALETTE[classes % len(PALETTE)].astype(np.float32)
    weight = 0.25 + 0.75 * mask.detach().float().cpu()[0].clamp(0, 1).numpy()[..., None]
    return Image.fromarray((colours * weight).round().astype(np.uint8), "RGB").resize((size, size), Image.NEAREST)


def pair_panel(
    first: torch.Tensor,
    second: torch.Tensor,
    mask1: torch.Tensor,
    mask2: torch.Tensor,
    confidence1: torch.Tensor | None,
    confidence2: torch.Tensor | None,
) -> Image.Image:
    """Two rows, one per image of a pair: the image, its predicted mask, its classes."""
    size = first.shape[-1]
    rows = []
    for image, mask, confidence in ((first, mask1, confidence1), (second, mask2, confidence2)):
        tiles = [to_pil(image), mask_picture(mask, size)]
        if confidence is not None:
            tiles.append(class_picture(confidence, mask, size))
        rows.append(tiles)
    panel = Image.new("RGB", (size * len(rows[0]) + 4 * (len(rows[0]) - 1), 2 * size + 4), (255, 255, 255))
    for r, tiles in enumerate(rows):
        for c, tile in enumerate(tiles):
            panel.paste(tile, (c * (size + 4), r * (size + 4)))
    return panel
