"""A Linear layer whose large fp32 CPU GEMMs run as oneDNN 1x1 convolutions.

torch's CPU `F.linear` calls MKL's sgemm, which on AMD EPYC takes a slow code path; the same
product written as a 1x1 convolution runs on oneDNN (the official VSRN code's Conv1d layout), which
measured faster there forward and backward at VSRN's large sizes (docs/benchmarks.md, "vldist
against the official VSRN code"). `Projection` keeps nn.Linear's parameters, init and state_dict
keys, so checkpoints load unchanged, and computes the same product: only the kernel differs.

The convolution path is taken only where it was measured faster: fp32 on CPU, outside autocast,
with at least `MIN_CONV_MACS` multiply-adds; everywhere else (CUDA, bf16/fp16, small products,
torch.compile, which picks its own kernels) it is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# rows x in x out multiply-adds from which the path is taken. On the 2-core EPYC the convolution
# alone beat F.linear at most shapes (bench/vs_official.py --kernels), but its output comes back
# column-major, and at the demo's sizes (at most 3.4e8 multiply-adds a projection) the whole step
# was level or slower with it; at the paper's (1.9e10 and up) it was faster. 2^30 lies between.
MIN_CONV_MACS = 2**30


def takes_conv_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` routes x @ weight^T through oneDNN's 1x1 convolution."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    if not torch.backends.mkldnn.is_available() or x.dim() < 2:
        return False
    rows = x.numel() // x.shape[-1]
    return rows * weight.shape[0] * weight.shape[1] >= MIN_CONV_MACS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on the faster CPU kernel where `takes_conv_path`."""
    if not takes_conv_path(x, weight):
        return F.linear(x, weight, bias)
    # All rows as one long sequence of channels: (1, in, rows) -> (1, out, rows). The transposes
    # are views; oneDNN reads the channels-last input as it lies.
    rows = x.reshape(-1, x.shape[-1])
    out = F.conv1d(rows.t().unsqueeze(0), weight.unsqueeze(-1), bias)
    return out.squeeze(0).t().reshape(*x.shape[:-1], weight.shape[0])


class Projection(nn.Linear):
    """nn.Linear (same parameters and state_dict) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
