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
        reduce = all_reduce_with_grad
        # Two passes (mean, then squared deviations) as BatchNorm computes them: the one-pass
        # E[x^2] - mean^2 cancels badly when the mean is large next to the spread.
        sums = reduce(torch.cat([x.sum(0), x.new_tensor([x.shape[0]])]))
        count = sums[-1]
        mean = sums[:-1] / count
        var = reduce(((x - mean) ** 2).sum(0)) / count  # biased, as BatchNorm normalises
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                # momentum None means a cumulative average, as in nn.BatchNorm1d
                weight = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.lerp_(mean.detach(), weight)
                self.running_var.lerp_(unbiased.detach(), weight)
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y * self.weight + self.bias if self.affine else y


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
