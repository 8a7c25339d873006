"""What some recipes can do besides training and evaluating, as Protocols: `python -m
vldist.caption` captions a user's images with a recipe that has one of them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CaptionsRegions(Protocol):
    """Captions images from their region features (the captioners)."""

    def caption(self, model: nn.Module, regions: list, device: torch.device) -> list[str]: ...


@runtime_checkable
class CaptionsPixels(Protocol):
    """Captions images from their pixels, `Recipe.images_per_caption` at a time (L2C: pairs)."""

    def caption_pixels(self, model: nn.Module, images: list, device: torch.device) -> list[str]: ...
