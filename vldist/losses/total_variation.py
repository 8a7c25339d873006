"""Total variation of confidence maps: L2C's Eq. 2, which makes neighbouring pixels agree on a class."""

from __future__ import annotations

import torch


def total_variation_loss(maps: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """maps (B, K, H, W) -> scalar.

    Eq. 2: Σ_{i,j} |C_{i+1,j} − C_{i,j}| + |C_{i,j+1} − C_{i,j}|, each difference summed where the
    neighbour exists, summed over B and K; "mean" divides by B·K·H·W so that λ does not depend on
    the batch size or the map's resolution, "sum" is the paper's plain sum (B·K·H·W times larger:
    7e4 for L2C's 32 images of 9 classes on 16 x 16 maps).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    vertical = (maps[:, :, 1:, :] - maps[:, :, :-1, :]).abs().sum()
    horizontal = (maps[:, :, :, 1:] - maps[:, :, :, :-1]).abs().sum()
    total = vertical + horizontal
    return total / maps.numel() if reduction == "mean" else total
