"""The precision the losses compute in: float32 at least, whatever autocast or the inputs say."""

from __future__ import annotations

import functools

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


def in_loss_precision(loss):
    """`loss` computed in `loss_dtype` of its floating-point tensor arguments, with autocast off
    inside. Under autocast the score matrices would be bf16 again, and bf16 embeddings (a model
    run under autocast without Accelerate's fp32 outputs) would keep the whole loss in bf16: its
    hardest negatives and a sum of thousands of hinges with 8 bits of mantissa (a phrase batch's
    loss came out as 8,768.0, a multiple of bf16's spacing of 64 there). The gradients flow back
    through the casts in the arguments' own dtypes."""

    @functools.wraps(loss)
    def in_precision(*args, **kwargs):
        floats = [x for x in (*args, *kwargs.values()) if isinstance(x, Tensor) and x.is_floating_point()]
        if not floats:
            return loss(*args, **kwargs)
        dtype = loss_dtype(*floats)

        def upcast(x):
            return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

        with no_autocast(floats[0]):
            return loss(*map(upcast, args), **{key: upcast(value) for key, value in kwargs.items()})

    return in_precision
