"""Region affinity aggregation, the core of VSRN's region relationship reasoning (RRR).

    Y = norm(theta @ phi^T) @ g          theta, phi, g: (B, K, D)

`count` divides the affinity by the number of valid regions (the official VSRN code, R / N);
`softmax` normalises each row with a softmax. Padded regions (mask False) neither give nor receive
messages: their columns are dropped from the affinity and their output rows are zero.

`region_affinity_torch` is the PyTorch reference; `region_affinity_triton.py` the fused kernel
that must match it; `region_affinity` picks one.
"""

from __future__ import annotations

import importlib.util
import os
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
        raise ValueError(
            f"theta, phi, g must all be (B, K, D); got {tuple(theta.shape)}, {tuple(phi.shape)}, {tuple(g.shape)}"
        )
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


Kernel = Literal["auto", "triton", "torch"]


# Looked up once: inside a compiled model dynamo reads a constant, where torch 2.11's dynamo breaks
# the graph at importlib's lookup (every GCN layer, measured on CPU)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_INSTALLED


# Where kernel=auto takes the Triton kernel, measured on an H100 (docs/benchmarks.md, `python
# bench/gcn_kernel.py [--dtype bf16]`): in bf16/fp16 it beat eager PyTorch 1.3-3.2x forward+backward
# at every shape; in fp32 only with few regions (K = 9: 1.5-2.2x), not at K = 36 (0.6-0.8x), where
# cuBLAS's fp32 GEMMs win.
HALF_PRECISION = (torch.bfloat16, torch.float16)
FP32_MAX_REGIONS = 16
MAX_REGIONS = 128  # one program holds an image's K x K affinity


def auto_kernel(device_type: str, dtype: torch.dtype, regions: int, triton_installed: bool) -> str:
    """The kernel kernel=auto runs: 'triton' on CUDA where it was measured faster, else 'torch'."""
    if device_type != "cuda" or not triton_installed or regions > MAX_REGIONS:
        return "torch"
    return "triton" if dtype in HALF_PRECISION or regions <= FP32_MAX_REGIONS else "torch"


def region_affinity(theta, phi, g, normalize: Normalize = "count", mask=None, kernel: Kernel = "auto"):
    """The fused Triton kernel on CUDA where it is faster (kernel=auto, `auto_kernel`) or when
    asked (kernel=triton; on CPU only under TRITON_INTERPRET=1), else the PyTorch reference."""
    if kernel == "auto":
        kernel = auto_kernel(theta.device.type, theta.dtype, theta.shape[1], triton_available())
    if kernel == "torch":
        return region_affinity_torch(theta, phi, g, normalize, mask)
    if kernel != "triton":
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', not {kernel!r}")
    if not triton_available():
        raise RuntimeError("model.gcn_kernel=triton but triton is not installed; use gcn_kernel=auto or torch")
    if not theta.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "model.gcn_kernel=triton on CPU needs TRITON_INTERPRET=1 in the environment (Triton's interpreter, "
            "for testing; slow); use gcn_kernel=auto to run the PyTorch reference on CPU"
        )
    from vldist.kernels.region_affinity_triton import region_affinity_triton

    return region_affinity_triton(theta, phi, g, normalize, mask)
