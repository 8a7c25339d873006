"""A Linear layer whose large fp32 CPU GEMMs run on whichever kernel measures faster on this CPU:
MKL's GEMM (F.linear) or oneDNN's 1x1 convolution.

torch's CPU `F.linear` calls MKL's sgemm. On the AMD EPYC this project measured first, MKL took a
slow code path and the same product as a 1x1 convolution on oneDNN (the official VSRN code's
Conv1d layout) was faster forward and backward at VSRN's large sizes; on an Intel Xeon (AVX-512)
MKL was the faster one, by up to 3x (docs/benchmarks.md, "vldist against the official VSRN code").
No rule of thumb holds across CPUs, so above a size threshold `Projection` times both kernels once
per shape in the process (forward and backward, on data of that shape) and keeps the faster. It
keeps nn.Linear's parameters, init and state_dict keys, so checkpoints load unchanged, and
computes the same product: only the kernel differs.

Only fp32 on CPU, outside autocast, with at least `MIN_CONV_MACS` multiply-adds is ever timed;
everywhere else (CUDA, bf16/fp16, small products, torch.compile, which picks its own kernels) it is
F.linear. `VLDIST_PROJECTION_KERNEL=linear|conv` skips the timing and fixes the kernel.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

# rows x in x out multiply-adds from which the convolution is considered. On the 2-core EPYC the
# convolution alone beat F.linear at most shapes (bench/vs_official.py --kernels), but its output
# comes back column-major, and at the demo's sizes (at most 3.4e8 multiply-adds a projection) the
# whole step was level or slower with it; at the paper's (1.9e10 and up) it was faster. 2^30 lies
# between, and keeps the one-off timing (a few forward-backward passes) small against a step.
MIN_CONV_MACS = 2**30

# "measured" (time both, keep the faster), or "conv" / "linear" to fix the kernel.
KERNEL = os.environ.get("VLDIST_PROJECTION_KERNEL", "measured")
# The convolution must beat F.linear by this factor to be kept: a near tie stays on F.linear.
CONV_MARGIN = 1.05

# (rows rounded up to a power of two, in, out, threads) -> whether the convolution measured faster
_conv_faster: dict[tuple[int, int, int, int], bool] = {}


def takes_conv_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` routes x @ weight^T through oneDNN's 1x1 convolution."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    if not torch.backends.mkldnn.is_available() or x.dim() < 2:
        return False
    rows = x.numel() // x.shape[-1]
    if rows * weight.shape[0] * weight.shape[1] < MIN_CONV_MACS or KERNEL == "linear":
        return False
    return KERNEL == "conv" or conv_measured_faster(rows, weight.shape[1], weight.shape[0])


def conv_measured_faster(rows: int, in_features: int, out_features: int) -> bool:
    """Whether the 1x1 convolution beat F.linear (forward and backward, fp32, this process's
    threads) on a product of about this shape: timed at the first call, then remembered. The
    timing draws from its own generator, so the run's random stream is untouched."""
    key = (1 << max(rows - 1, 0).bit_length(), in_features, out_features, torch.get_num_threads())
    if key not in _conv_faster:
        _conv_faster[key] = _time_kernels(rows, in_features, out_features)
    return _conv_faster[key]


def _time_kernels(rows: int, in_features: int, out_features: int, conv=None, plain=None, repeats: int = 2) -> bool:
    """Whether `conv` (default: the 1x1 convolution) beat `plain` (default: F.linear) by CONV_MARGIN."""
    conv, plain = conv or conv_linear, plain or F.linear

    def seconds(product, inputs) -> float:
        best = float("inf")
        for _ in range(repeats + 1):  # the first call warms the kernel up
            leaves = [t.detach().requires_grad_() for t in inputs]
            start = time.perf_counter()
            y = product(*leaves)
            y.backward(torch.ones_like(y))
            best = min(best, time.perf_counter() - start)
        return best

    # out of inference mode: an evaluation's first call may be the one that times
    with torch.inference_mode(False), torch.enable_grad():
        generator = torch.Generator().manual_seed(0)
        x = torch.empty(rows, in_features).normal_(generator=generator)
        weight = torch.empty(out_features, in_features).normal_(std=in_features**-0.5, generator=generator)
        inputs = (x, weight, torch.zeros(out_features))
        return seconds(conv, inputs) * CONV_MARGIN < seconds(plain, inputs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on the faster CPU kernel where `takes_conv_path`."""
    if not takes_conv_path(x, weight):
        return F.linear(x, weight, bias)
    return conv_linear(x, weight, bias)


def conv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # All rows as one long sequence of channels: (1, in, rows) -> (1, out, rows). The transposes
    # are views; oneDNN reads the channels-last input as it lies.
    rows = x.reshape(-1, x.shape[-1])
    out = F.conv1d(rows.t().unsqueeze(0), weight.unsqueeze(-1), bias)
    return out.squeeze(0).t().reshape(*x.shape[:-1], weight.shape[0])


class Projection(nn.Linear):
    """nn.Linear (same parameters and state_dict) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
