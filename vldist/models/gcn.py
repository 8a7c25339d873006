"""Region relationship reasoning (VSRN, Sec. 3.2): a GCN layer over the fully connected region graph.

    R   = norm(theta(V) phi(V)^T)          affinity, Eq. 2 (row-normalised)
    V*  = BN(W_r (R g(V))) + V             Eq. 3 with the residual of the official code

theta, phi, g and W_r are D x D projections (the official code's 1x1 convolutions; theta, phi and
g are computed as one D -> 3D projection); BN's weight and bias start at zero, so every layer
starts as the identity and reasoning is learned. The affinity-normalise-aggregate step runs in the
fused Triton kernel on CUDA (`kernel`: auto | triton | torch, see vldist/kernels/).

`products`: the same layer in fewer multiply-adds when there are more region rows than channels.
Both pairs of projections are linear maps composed with each other, so their weights can be
multiplied first (A = W_theta^T W_phi and M = W_g^T W_r^T, D x D each):

    theta(V) phi(V)^T = (V A + 1 a^T) V^T + r 1^T      a = W_phi^T b_theta, r = V W_theta^T b_phi + b_theta.b_phi
    W_r(R' g(V))      = (R' V) M + (R' 1)(W_r b_g)^T + b_r

Per layer that is 2 products over the rows (V A, (R'V) M) and 2 of D^3, against 4 over the rows:
forward and backward, 6 rows D^2 + 6 D^3 multiply-adds against 12 rows D^2, fewer wherever the
batch has more region rows than D (VSRN at the paper's sizes, 4,608 rows of 2,048: 28% fewer; the
step x1.16 faster on a 2-core CPU, docs/benchmarks.md). The parameters, their gradients and the
output are the same up to float rounding (tests/unit/test_gcn.py); only the order of the products
changes. `auto` folds where that count is lower, the PyTorch affinity runs (the Triton kernel takes
theta, phi and g), the step computes in fp32 (no autocast) and nothing compiles it (its test of the
batch size would be a shape guard); `direct` never folds, `folded` wherever the weights are whole.
Weights sharded away from this process (ZeRO-3's partitions, an FSDP2 DTensor) are never folded:
ZeRO-3 gathers a module's weights only when its own forward runs.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from vldist.distributed.zero import partitioned
from vldist.kernels import region_affinity
from vldist.kernels.region_affinity import auto_kernel, region_affinity_torch, triton_available
from vldist.models.global_batchnorm import masked_batch_norm
from vldist.models.projection import Projection

Products = Literal["auto", "folded", "direct"]


class RegionRelationReasoning(nn.Module):
    def __init__(self, dim: int, normalize: str = "count", kernel: str = "auto", products: Products = "auto"):
        super().__init__()
        if products not in ("auto", "folded", "direct"):
            raise ValueError(f"products must be 'auto', 'folded' or 'direct', not {products!r}")
        self.normalize, self.kernel, self.products = normalize, kernel, products
        # theta, phi and g as one (D -> 3D) projection: one GEMM instead of three
        # Projection: nn.Linear's parameters, on oneDNN's faster CPU kernel where it measured faster
        self.theta_phi_g = Projection(dim, 3 * dim)
        self.w_r = Projection(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        nn.init.zeros_(self.bn.weight)
        nn.init.zeros_(self.bn.bias)

    def forward(self, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """v: (B, K, D) region features; mask: (B, K), True for real regions."""
        if self.folds(v):
            return v + self._normalized_residual(self._folded_messages(v, mask), mask)
        theta, phi, g = self.theta_phi_g(v).chunk(3, dim=-1)
        y = region_affinity(theta, phi, g, self.normalize, mask, self.kernel)
        return v + self._normalized_residual(self.w_r(y), mask)

    def folds(self, v: torch.Tensor) -> bool:
        """Whether this input takes the folded products (`products`, the module docstring)."""
        weights = (self.theta_phi_g.weight, self.w_r.weight)
        if self.products == "direct" or partitioned(weights) or any(_sharded(w) for w in weights):
            return False
        if self.products == "folded":
            return True
        dim = v.shape[-1]
        kernel = self.kernel
        if kernel == "auto":
            kernel = auto_kernel(v.device.type, v.dtype, v.shape[1], triton_available())
        return (
            # under torch.compile a test of the batch size would be a shape guard, and a ragged last
            # batch would recompile: compiled code keeps the direct products
            not torch.compiler.is_compiling()
            and v.numel() // dim > dim  # more rows than channels: fewer multiply-adds
            and kernel == "torch"
            and v.dtype == torch.float32
            and not torch.is_autocast_enabled(v.device.type)
        )

    def _folded_messages(self, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """W_r(norm(theta phi^T) g), with the weights multiplied first (the module docstring)."""
        (w_theta, w_phi, w_g), (b_theta, b_phi, b_g) = self.theta_phi_g.weight.chunk(3), self.theta_phi_g.bias.chunk(3)
        rows = v.flatten(0, 1)
        theta = torch.addmm(w_phi.t() @ b_theta, rows, w_theta.t() @ w_phi).view_as(v)
        row_bias = v @ (w_theta.t() @ b_phi) + b_theta @ b_phi
        # one more channel carries the bias terms: [theta | r] . [v | 1] is theta(v) phi(v)^T, and
        # norm(R) [v | 1] gives both R'V and R'1
        with_one = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        y = region_affinity_torch(
            torch.cat([theta, row_bias.unsqueeze(-1)], dim=-1), with_one, with_one, self.normalize, mask
        )
        y_v, y_1 = y[..., :-1], y[..., -1:]
        messages = torch.addmm(self.w_r.bias, y_v.flatten(0, 1), w_g.t() @ self.w_r.weight.t()).view_as(v)
        return messages + y_1 * (self.w_r.weight @ b_g)

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


def _sharded(weight: torch.Tensor) -> bool:
    """An FSDP2 shard: a DTensor (which has a device mesh), not the whole weight."""
    return hasattr(weight, "device_mesh")
