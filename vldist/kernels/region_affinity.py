"""Region affinity aggregation, the core of VSRN's region relationship reasoning (RRR).

    Y = norm(theta @ phi^T) @ g          theta, phi, g: (B, K, D)

`count` divides the affinity by the number of valid regions (the official VSRN code, R / N);
`softmax` normalises each row with a softmax. Padded regions (mask False) neither give nor receive
messages: their columns are dropped from the affinity and their output rows are zero.

This is the PyTorch reference; a fused kernel must match it.
"""

from __future__ import annotations

from typing import Literal

import torch

Normalize = Literal["count", "softmax"]


def region_affinity_torch(
    theta: torch.Tensor,
    phi: torch.Tensor,
    g: torch.Tensor,
    normalize: Normalize = "count",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    if not theta.shape == phi.shape == g.shape or theta.dim() != 3:
        raise ValueError(f"theta, phi, g must all be (B, K, D); got {tuple(theta.shape)}, {tuple(phi.shape)}, {tuple(g.shape)}")
    affinity = theta @ phi.transpose(1, 2)  # (B, K, K): row i = how much region i attends to j
    if normalize == "count":
        if mask is None:
            affinity = affinity / theta.shape[1]
        else:
            counts = mask.sum(dim=1).clamp(min=1).to(affinity.dtype)
            affinity = affinity.masked_fill(~mask[:, None, :], 0.0) / counts[:, None, None]
    elif normalize == "softmax":
        if mask is not None:
            # finfo.min rather than -inf keeps a fully padded row finite (uniform) instead of NaN.
            affinity = affinity.masked_fill(~mask[:, None, :], torch.finfo(affinity.dtype).min)
        affinity = affinity.softmax(dim=-1)
    else:
        raise ValueError(f"normalize must be 'count' or 'softmax', not {normalize!r}")
    out = affinity @ g
    if mask is not None:
        out = out.masked_fill(~mask[:, :, None], 0.0)
    return out


def region_affinity(theta, phi, g, normalize: Normalize = "count", mask=None):
    """Dispatch point for fused implementations; today the PyTorch reference."""
    return region_affinity_torch(theta, phi, g, normalize, mask)
