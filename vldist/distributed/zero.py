"""Whole parameters for a moment under DeepSpeed ZeRO-3, where each rank holds a slice of each."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn


def whole_parameters(params: list[nn.Parameter]):
    """A context with every parameter whole (ZeRO-3's gather; rank 0's values kept when it
    changes them), or nothing when no parameter is partitioned."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    return nullcontext()
