"""Decoding the image members of recipes that read pixels (L2C): RGB images and foreground masks.

Both raise ValueError naming the sample on corrupt input; the pipeline then skips and counts it.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

# torchvision's ImageNet statistics: the trunks are ResNets (or start like one)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def image_tensor(image: Image.Image, size: int, value_range: str = "imagenet") -> torch.Tensor:
    """A PIL image as a normalised (3, size, size) float tensor (resized, aspect ratio not kept:
    the synthetic scenes are square, and an FCN trunk takes any shape). value_range "imagenet":
    ImageNet's mean and std (ResNet trunks); "tanh": [-1, 1], a generator's output range (LAViTeR)."""
    rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    return pixels * 2 - 1 if value_range == "tanh" else (pixels - MEAN) / STD


def read_image(raw: dict, member: str, size: int, value_range: str = "imagenet") -> torch.Tensor:
    """The sample's image member (e.g. 'img1.jpg') as image_tensor."""
    try:
        with Image.open(io.BytesIO(raw[member])) as opened:
            return image_tensor(opened, size, value_range)
    except KeyError:
        raise ValueError(f"sample {raw['__key__']} has no {member}") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ValueError(f"{member} of {raw['__key__']} cannot be decoded ({type(err).__name__}: {err})") from None


def read_mask(raw: dict, member: str, size: int) -> torch.Tensor | None:
    """The sample's foreground mask member (an 8-bit PNG, 0 background) as a (1, size, size) float
    tensor of 0/1, or None when the sample has none (masks train the segmentation head only)."""
    if member not in raw:
        return None
    try:
        with Image.open(io.BytesIO(raw[member])) as opened:
            mask = opened.convert("L").resize((size, size), Image.NEAREST)
    except (OSError, ValueError, SyntaxError) as err:
        raise ValueError(f"{member} of {raw['__key__']} cannot be decoded ({type(err).__name__}: {err})") from None
    return torch.from_numpy((np.asarray(mask) > 127).astype(np.float32))[None]


def stack_masks(masks: list[torch.Tensor | None], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, size, size) masks (zeros where missing) and a (B,) bool tensor: which are real."""
    present = torch.tensor([m is not None for m in masks])
    stacked = torch.stack([m if m is not None else torch.zeros(1, size, size) for m in masks])
    return stacked, present
