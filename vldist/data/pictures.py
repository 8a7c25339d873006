"""Pictures of what a model computed, saved beside its evaluation so a person can look at them:
image tensors back to pictures, and the writing of the pictures a recipe returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vldist.data.pixels import MEAN, STD


def to_pil(image: torch.Tensor, value_range: str = "imagenet") -> Image.Image:
    """A (3, H, W) image tensor back to RGB: ImageNet-normalised ("imagenet") or in [0, 1] ("unit")."""
    pixels = image.detach().float().cpu()
    pixels = (pixels if value_range == "unit" else pixels * STD + MEAN).clamp(0, 1)
    return Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), "RGB")


def save_pictures(pictures: dict[str, Image.Image], directory: Path) -> list[str]:
    """Write each picture as PNG under `directory`; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, picture in pictures.items():
        path = directory / name
        picture.save(path, format="PNG")
        paths.append(str(path))
    return paths
