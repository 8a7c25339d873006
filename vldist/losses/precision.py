"""The precision the losses compute in: float32 at least, whatever autocast or the inputs say."""

from __future__ import annotations

import torch
from torch import Tensor


def loss_dtype(*xs: Tensor) -> torch.dtype:
    """float32 at least: bf16/fp16 inputs are upcast, float64 stays float64."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def no_autocast(x: Tensor):
    """Autocast off on x's device: it would run the matmuls in bf16/fp16 again."""
    return torch.autocast(device_type=x.device.type, enabled=False)
