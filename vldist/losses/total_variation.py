"""Total variation of confidence maps: L2C's Eq. 2, which makes neighbouring pixels agree on a class."""

from __future__ import annotations

import torch


def total_variation_loss(maps: torch.Tensor) -> torch.Tensor:
    """maps (B, K, H, W) -> scalar.

    Eq. 2: Σ_{i,j} |C_{i+1,j} − C_{i,j}| + |C_{i,j+1} − C_{i,j}|, each difference summed where the
    neighbour exists, summed over B and K and divided by B·K·H·W so that λ does not depend on
    the batch size or the map's resolution.
    """
    vertical = (maps[:, :, 1:, :] - maps[:, :, :-1, :]).abs().sum()
    horizontal = (maps[:, :, :, 1:] - maps[:, :, :, :-1]).abs().sum()
    return (vertical + horizontal) / maps.numel()
