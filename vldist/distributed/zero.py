"""Whole parameters for a moment under DeepSpeed ZeRO-3, where each rank holds a slice of each."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn


def partitioned(params) -> bool:
    """Whether DeepSpeed ZeRO-3 manages any of these parameters: it gathers each in the hooks of
    the module that owns it, so code that reads them without calling that module sees empty
    partitions (and each call gathers across ranks)."""
    return any(hasattr(p, "ds_id") for p in params)


def whole_parameters(params: list[nn.Parameter]):
    """A context with every parameter whole (ZeRO-3's gather; rank 0's values kept when it
    changes them), or nothing when no parameter is partitioned."""
    if partitioned(params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    return nullcontext()
