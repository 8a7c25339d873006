"""L2C's semantic pooling (Sec. 2.1): K graph nodes from a feature map, a mask and confidence maps.

    v_k = Σ_{i,j} F ⊙ B ⊙ C_k        Eq. 1

F (B, D, H, W) are the trunk's features, B the object mask and C (B, K, H, W) a distribution over
K classes at each pixel, predicted from F by `SemanticPooling`.
"""

from __future__ import annotations

import torch
from torch import nn

_EPS = 1e-6  # keeps an empty mask (or an unused class) from dividing by zero


def _as_plane(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, H, W) or (B, H, W) -> (B, H, W)."""
    return mask[:, 0] if mask.dim() == 4 else mask


def semantic_pool(
    features: torch.Tensor, mask: torch.Tensor, confidence: torch.Tensor, normalize: bool = False
) -> torch.Tensor:
    """Eq. 1: v (B, K, D) with v_k = Σ_{i,j} F ⊙ B ⊙ C_k, the paper's unnormalised sum.

    features (B, D, H, W); mask (B, 1, H, W) or (B, H, W), values in [0, 1]; confidence (B, K, H, W).
    normalize=True divides each v_k by Σ_{i,j} B·C_k (clamped away from 0): a weighted mean whose
    scale does not grow with the object's area or the map's resolution. Not in the paper.
    """
    plane = _as_plane(mask).to(features.dtype)
    nodes = torch.einsum("bdhw,bhw,bkhw->bkd", features, plane, confidence)
    if not normalize:
        return nodes
    weight = torch.einsum("bhw,bkhw->bk", plane, confidence)
    return nodes / weight.clamp(min=_EPS).unsqueeze(-1)


def masked_average_pool(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ F·B / Σ B as one node (B, 1, D): the "− semantic pooling" ablation of Table 3."""
    plane = _as_plane(mask).to(features.dtype)
    total = torch.einsum("bdhw,bhw->bd", features, plane)
    return (total / plane.sum(dim=(1, 2)).clamp(min=_EPS).unsqueeze(-1)).unsqueeze(1)


class SemanticPooling(nn.Module):
    """The pooling module: conv 3x3, BN, ReLU, conv 1x1, softmax over the K classes at each pixel."""

    def __init__(self, in_dim: int, classes: int = 9, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_dim, hidden, kernel_size=3, padding=1, bias=False),  # BN follows: no bias
            nn.BatchNorm2d(hidden),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, classes, kernel_size=1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, D, H, W) -> C (B, K, H, W), non-negative, summing to 1 over K."""
        return self.net(features).softmax(dim=1)
