"""The few collectives vldist uses, each a no-op in a single process. Each says so in this rank's
heartbeat while it waits (heartbeat.py: the watchdog names a rank stuck outside them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from vldist.distributed.heartbeat import heartbeat


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# The ranks whose rows are each other's negatives: None for all of them (the default, and the
# exact global batch), else this rank's block of train.negatives_group_size consecutive ranks.
_negatives_group = None


def set_negatives_group_size(size: int | None) -> None:
    """Collective. Cross-batch objectives (every all-gather below) gather among consecutive blocks
    of `size` ranks, e.g. the ranks of one node; None, or the world size: among all ranks."""
    global _negatives_group
    _negatives_group = None
    rank, world_size = world()
    if size is None or size >= world_size:
        return
    if world_size % size:
        from vldist.errors import ConfigError

        raise ConfigError(
            f"train.negatives_group_size={size} must divide the {world_size} ranks of the job into equal "
            "blocks (e.g. the ranks of a node), or be left unset for the whole global batch"
        )
    _negatives_group, _ = dist.new_subgroups(group_size=size)


def negatives_world() -> tuple[int, int, object]:
    """(this rank's place, the number of ranks, the process group) among which negatives are
    gathered: the whole job by default (group None)."""
    if _negatives_group is None:
        return (*world(), None)
    return dist.get_rank(_negatives_group), dist.get_world_size(_negatives_group), _negatives_group


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks. Every rank's output depends on every rank's input, so the gradient of an
    input is the sum over ranks of the output gradients: an all-reduce again."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        out = x.clone()
        with heartbeat.collective("all_reduce"):
            dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.clone()
        with heartbeat.collective("all_reduce (backward)"):
            dist.all_reduce(grad)
        return grad


class _AllGather(torch.autograd.Function):
    """Stack of every rank's x (same shape everywhere). Rank r's slot j is rank j's input, so the
    gradient of rank j's input is the sum over ranks of their slot-j gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group=None) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        with heartbeat.collective("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        # gloo has no reduce-scatter: the whole gathered gradient is all-reduced, and each rank
        # keeps its slot (docs/distributed.md, "What global negatives cost", counts the bytes)
        grad = grad.contiguous()
        with heartbeat.collective("all_reduce (all_gather backward)"):
            dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_reduce_with_grad(x: Tensor) -> Tensor:
    """Sum of x over ranks, differentiable (the global BatchNorm's statistics)."""
    return _AllReduceSum.apply(x) if world()[1] > 1 else x


def all_gather_with_grad(x: Tensor) -> tuple[Tensor, int]:
    """(every rank's x concatenated along dim 0 in rank order, where this rank's rows start).

    Backward returns each rank the gradient of its own rows. Ranks may hold different numbers of
    rows (the last batch of an exact epoch): rows are padded to the largest count for the
    collective and the padding is cut off again. "Every rank": of this rank's negatives group
    (set_negatives_group_size; the whole job by default).
    """
    rank, size, group = negatives_world()
    if size == 1:
        return x, 0
    counts = torch.tensor([x.shape[0]], device=x.device)
    all_counts = [torch.zeros_like(counts) for _ in range(size)]
    with heartbeat.collective("all_gather (row counts)"):
        dist.all_gather(all_counts, counts, group=group)
    rows = [int(c) for c in all_counts]
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, max(rows) - x.shape[0]))
    parts = _AllGather.apply(padded, group)
    return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)], dim=0), sum(rows[:rank])


def global_sum(x: Tensor) -> Tensor:
    """Sum of a detached value over ranks, e.g. the global loss from every rank's share."""
    x = x.detach().clone()
    if world()[1] > 1:
        device = x.device
        if dist.get_backend() == "nccl" and device.type != "cuda":
            x = x.cuda()  # NCCL reduces CUDA tensors only
        with heartbeat.collective("all_reduce"):
            dist.all_reduce(x)
        x = x.to(device)
    return x


def global_max(n: int, device: torch.device) -> int:
    """The largest n over ranks (e.g. the widest padding), n itself in one process."""
    if world()[1] == 1:
        return n
    x = torch.tensor([n], device=device)
    if dist.get_backend() == "nccl" and x.device.type != "cuda":
        x = x.cuda()  # NCCL reduces CUDA tensors only
    with heartbeat.collective("all_reduce (max)"):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return int(x)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    size = world()[1]
    if size == 1:
        return [obj]
    out = [None] * size
    with heartbeat.collective("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def all_gather_rows(x: Tensor) -> tuple[Tensor, int]:
    """(every rank's x concatenated along dim 0 in rank order, where this rank's rows start), for
    tensors of any dtype (token ids, image ids) and without gradient.

    Ranks may hold different numbers of rows; every other dimension must agree across ranks.
    "Every rank": of this rank's negatives group, as in all_gather_with_grad.
    """
    if x.dim() == 0:
        raise ValueError("all_gather_rows needs a tensor with at least one dimension (rows), got a scalar")
    rank, size, group = negatives_world()
    if size == 1:
        return x, 0
    device = x.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        x = x.cuda()  # NCCL gathers CUDA tensors only
    with torch.no_grad(), heartbeat.collective("all_gather (rows)"):
        shape = torch.tensor(x.shape, device=x.device)  # the same number of dims on every rank
        shapes = [torch.zeros_like(shape) for _ in range(size)]
        dist.all_gather(shapes, shape, group=group)
        if any(not torch.equal(s[1:], shape[1:]) for s in shapes):
            raise ValueError(
                f"all_gather_rows: every dimension but the first must agree across ranks; "
                f"got shapes {[tuple(s.tolist()) for s in shapes]}"
            )
        rows = [int(s[0]) for s in shapes]
        padded = torch.zeros((max(rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        out = torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)], dim=0)
    return out.to(device), sum(rows[:rank])
