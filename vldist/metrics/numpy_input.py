"""Metric inputs as numpy arrays: where a torch tensor, on any device and of any dtype, becomes one."""

from __future__ import annotations

import numpy as np
import torch


def to_numpy(x, *, float64: bool = False, copy: bool = False) -> np.ndarray:
    """`x` (torch tensor, numpy array, nested list, ...) as a numpy array; a tensor is detached and
    brought to the CPU.

    float64: convert to float64. Float tensors are converted by torch, since bf16 has no numpy dtype;
        integer and bool tensors are converted by numpy (to the same values).
    copy: the result never shares memory with `x` (for callers that write into it).
    """
    dtype = np.float64 if float64 else None
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach()
        if float64 and x.is_floating_point():
            # One conversion that copies only when asked: .double() of a float64 CPU tensor is the
            # tensor itself.
            return x.to("cpu", torch.float64, copy=copy).numpy()
        x = x.cpu().numpy()
    return np.array(x, dtype=dtype) if copy else np.asarray(x, dtype=dtype)
