"""BatchNorm whose batch statistics cover every rank's rows, on CPU (gloo) as well as CUDA.

torch.nn.SyncBatchNorm refuses CPU tensors, and VSRN's RRR layers normalise a variable number of
real (unpadded) region rows per rank. Here the per-channel sums and row counts, then the squared deviations, are
all-reduced with a differentiable all-reduce, so the forward uses the global mean and variance and
the backward sends each rank its exact share of the gradient. With one process it is BatchNorm1d.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vldist.distributed.collectives import all_reduce_with_grad, world


def _distributed() -> bool:
    return world()[1] > 1


class GlobalBatchNorm1d(nn.BatchNorm1d):
    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and _distributed()):
            return super().forward(x)
        if x.dim() != 2:
            raise ValueError(f"GlobalBatchNorm1d takes (rows, channels), got {tuple(x.shape)}")
        return _normalize_with_batch_statistics(self, x, None, all_reduce_with_grad)


def masked_batch_norm(bn: nn.BatchNorm1d, x: Tensor, rows: Tensor) -> Tensor:
    """`bn` over the rows of x (N, C) where `rows` (N,) is True, the other rows zero: what
    scattering bn(x[rows]) back into zeros gives (statistics, running statistics, gradients),
    computed with row weights instead of selecting the rows, so every shape is static and
    torch.compile traces it whole (x[rows] has a data-dependent shape: a graph break). A
    GlobalBatchNorm1d in a multi-rank run takes its statistics over every rank's real rows."""
    if not bn.training and bn.track_running_stats:  # running statistics: row by row already
        return bn(x) * rows.to(x.dtype).unsqueeze(-1)
    # the row weights in the statistics' float32 at least: a bf16 sum of ones stops counting
    # exactly past 256 (1,001 real rows summed to 1,000), which would skew the mean and variance
    keep = rows.to(torch.promote_types(x.dtype, torch.float32)).unsqueeze(-1)
    distributed = isinstance(bn, GlobalBatchNorm1d) and _distributed()
    reduce = all_reduce_with_grad if distributed else _local
    return _normalize_with_batch_statistics(bn, x, keep, reduce) * keep


def _local(t: Tensor) -> Tensor:
    return t


def _normalize_with_batch_statistics(bn: nn.BatchNorm1d, x: Tensor, keep: Tensor | None, reduce) -> Tensor:
    """BatchNorm's training forward over the rows `keep` (N, 1) weighs by (all rows when None),
    with the sums passed through `reduce` (an all-reduce: the statistics of every rank). In float32
    at least, as BatchNorm keeps its statistics: under bf16 autocast x arrives in bf16, whose 8-bit
    mantissa would sum thousands of rows badly, and the running statistics are float32."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    weighted, rows = (x, x.new_tensor([x.shape[0]])) if keep is None else (x * keep, keep.sum(0))
    # Two passes (mean, then squared deviations) as BatchNorm computes them: the one-pass
    # E[x^2] - mean^2 cancels badly when the mean is large next to the spread.
    sums = reduce(torch.cat([weighted.sum(0), rows]))
    count = sums[-1]
    mean = sums[:-1] / count
    deviations = (x - mean) ** 2
    var = reduce((deviations if keep is None else deviations * keep).sum(0)) / count  # biased, as BatchNorm normalises
    if bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked += 1
            # momentum None means a cumulative average, as in nn.BatchNorm1d
            weight = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            unbiased = var * count / (count - 1).clamp(min=1)
            bn.running_mean.lerp_(mean.detach(), weight)
            bn.running_var.lerp_(unbiased.detach(), weight)
    y = (x - mean) / torch.sqrt(var + bn.eps)
    return y * bn.weight + bn.bias if bn.affine else y


def convert_global_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm1d in `module` by a GlobalBatchNorm1d with the same state."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm1d:
            replacement = GlobalBatchNorm1d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            replacement.load_state_dict(child.state_dict())
            if child.affine:  # the same Parameter objects: an optimizer built before still holds them
                replacement.weight, replacement.bias = child.weight, child.bias
            setattr(module, name, replacement)
        else:
            convert_global_batchnorm(child)
    return module
