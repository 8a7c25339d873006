"""Region relationship reasoning (VSRN, Sec. 3.2): a GCN layer over the fully connected region graph.

    R   = norm(theta(V) phi(V)^T)          affinity, Eq. 2 (row-normalised)
    V*  = BN(W_r (R g(V))) + V             Eq. 3 with the residual of the official code

theta, phi, g and W_r are D x D projections (the official code's 1x1 convolutions; theta, phi and
g are computed as one D -> 3D projection); BN's weight and bias start at zero, so every layer
starts as the identity and reasoning is learned. The affinity-normalise-aggregate step runs in the
fused Triton kernel on CUDA (`kernel`: auto | triton | torch, see vldist/kernels/).
"""

from __future__ import annotations

import torch
from torch import nn

from vldist.kernels import region_affinity
from vldist.models.global_batchnorm import masked_batch_norm
from vldist.models.projection import Projection


class RegionRelationReasoning(nn.Module):
    def __init__(self, dim: int, normalize: str = "count", kernel: str = "auto"):
        super().__init__()
        self.normalize, self.kernel = normalize, kernel
        # theta, phi and g as one (D -> 3D) projection: one GEMM instead of three
        # Projection: nn.Linear's parameters, on oneDNN's faster CPU kernel where it measured faster
        self.theta_phi_g = Projection(dim, 3 * dim)
        self.w_r = Projection(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        nn.init.zeros_(self.bn.weight)
        nn.init.zeros_(self.bn.bias)

    def forward(self, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """v: (B, K, D) region features; mask: (B, K), True for real regions."""
        theta, phi, g = self.theta_phi_g(v).chunk(3, dim=-1)
        y = region_affinity(theta, phi, g, self.normalize, mask, self.kernel)
        return v + self._normalized_residual(self.w_r(y), mask)

    def _normalized_residual(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # BatchNorm over real regions only: padding must not shift the batch statistics. Without
        # padding both branches compute the same; compiled code takes the masked one rather than
        # ask the device whether there is any (a host sync, and a graph break under torch.compile).
        compiling = torch.compiler.is_compiling()
        if mask is None or (not compiling and bool(mask.all())):
            return self.bn(x.flatten(0, 1)).view_as(x)
        if compiling:  # rows weighted instead of selected: static shapes, no graph break
            return masked_batch_norm(self.bn, x.flatten(0, 1), mask.flatten()).view_as(x)
        # eager: through the module, whose hooks train.activation_checkpointing relies on
        out = torch.zeros_like(x)
        out[mask] = self.bn(x[mask])
        return out
