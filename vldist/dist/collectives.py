"""The few collectives vldist uses, each a no-op in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_with_grad(x: Tensor) -> Tensor:
    """Every rank's x concatenated along dim 0 (rank order); backward returns each rank its part."""
    if world()[1] == 1:
        return x
    import torch.distributed.nn  # noqa: F401 - registers the autograd-aware collectives

    return torch.cat(torch.distributed.nn.functional.all_gather(x), dim=0)


def global_sum(x: Tensor) -> Tensor:
    """Sum of a detached value over ranks, e.g. the global loss from every rank's share."""
    x = x.detach().clone()
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    size = world()[1]
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj)
    return out
