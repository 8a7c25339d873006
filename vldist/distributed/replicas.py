"""Do the ranks still hold the same model? A check of the replicated state, in one collective.

Data parallelism keeps one replica of the model on every rank and relies on every rank applying
the same update. A recipe whose forward skips the engine's wrapper (it would have to override
the final `Recipe.training_losses`: no gradient all-reduce), a nondeterministic kernel, or a device that corrupts a value silently lets one
replica drift, and nothing else would notice: rank 0 evaluates and checkpoints its own copy.

After the first update of a process and every `train.replica_check_every` steps, each rank hashes
every replicated tensor (parameters and buffers, in the model's own order), the ranks exchange the
hashes in one all-gather, and each compares them. On a mismatch every rank reaches the same
verdict and raises ReplicasDiverged, naming the step, the first tensor that differs and which
ranks hold which value.

Not compared: what is not replicated by design. BatchNorm's running statistics are each rank's
own without engine.sync_batchnorm (the engine does not broadcast buffers; rank 0's are evaluated
and saved), ZeRO-3's partitioned parameters are empty placeholders on every rank, and FSDP2's
are each rank's own slices (DTensors; their buffers are replicated and compared).

The hash is exact, not a float sum: a tensor's bits read as integers, each weighted by its
position, modulo a prime (torch has no tensor hash; Python's would copy every tensor to the host).
Any one flipped bit changes it; two different tensors share it with a chance of about 1 in 2^31.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vldist.distributed.collectives import gather_objects
from vldist.errors import ReplicasDiverged
from vldist.models.global_batchnorm import GlobalBatchNorm1d

log = logging.getLogger("vldist.train")

PRIME = 2**31 - 1  # the modulus: a single changed word times a nonzero weight is never 0 mod a prime
ROW = 2**16  # words weighted 1..ROW within a row, rows weighted likewise: sums stay under 2^63
BLOCK_ROWS = 64  # rows hashed at once: bounds the int64 copy to 32 MiB per block


# the integer type of each element size: a tensor's values read as words of their own width
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_hash(tensor: torch.Tensor) -> int:
    """An exact hash of a tensor's bits: its elements read as integers of their width, times their
    position's weight, summed modulo PRIME, per row of ROW words and then over rows."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    words = flat.view(WORDS[flat.element_size()])
    rows = -(-words.numel() // ROW)
    weights = torch.arange(1, ROW + 1, dtype=torch.int64, device=words.device)
    row_sums = []
    for first in range(0, rows, BLOCK_ROWS):
        block = words[first * ROW : (first + BLOCK_ROWS) * ROW].to(torch.int64) % PRIME
        padded = torch.nn.functional.pad(block, (0, -block.numel() % ROW)).view(-1, ROW)
        row_sums.append((padded * weights).sum(dim=1) % PRIME)  # < 2^31 * 2^16 * 2^16: no overflow
    sums = torch.cat(row_sums)
    total = 0
    for first in range(0, sums.numel(), ROW):  # more than ROW rows only past 2^32 words
        part = sums[first : first + ROW]
        total = (total + int((part * weights[: part.numel()]).sum()) % PRIME * (first // ROW + 1)) % PRIME
    return total


def replicated_tensors(model: nn.Module, sync_batchnorm: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what every rank holds the same, in the model's order (see the module
    docstring for what is left out)."""
    local = {
        id(buffer)
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        and not (sync_batchnorm and isinstance(module, GlobalBatchNorm1d))
        for name, buffer in module.named_buffers(recurse=False)
        if name in ("running_mean", "running_var")
    }
    parameters = [
        (f"parameter {n}", p) for n, p in model.named_parameters() if p.numel() > 0 and not hasattr(p, "placements")
    ]
    buffers = [(f"buffer {n}", b) for n, b in model.named_buffers() if id(b) not in local and b.numel() > 0]
    return parameters + buffers


class ReplicaCheck:
    """Compares the ranks' replicas after the first update this process makes and every `every`
    steps (0: never; one rank: nothing to compare)."""

    def __init__(self, model: nn.Module, world_size: int, every: int, sync_batchnorm: bool):
        self.model, self.world_size, self.every, self.sync_batchnorm = model, world_size, every, sync_batchnorm
        self.passed_at: int | None = None  # the step of the last check that passed

    def due(self, step: int) -> bool:
        if self.world_size < 2 or not self.every:
            return False
        return self.passed_at is None or step % self.every == 0

    def check(self, step: int) -> None:
        """Collective. Raise ReplicasDiverged on every rank if any two ranks' replicas differ."""
        tensors = replicated_tensors(self.model, self.sync_batchnorm)
        hashes = gather_objects([tensor_hash(t) for _, t in tensors])  # one all-gather of a few ints
        differing = [i for i in range(len(tensors)) if len({rank[i] for rank in hashes}) > 1]
        if differing:
            raise ReplicasDiverged(
                _diverged(
                    step,
                    tensors[differing[0]][0],
                    [rank[differing[0]] for rank in hashes],
                    len(differing),
                    len(tensors),
                    self.passed_at,
                )
            )
        if self.passed_at is None:
            log.info(
                "replica check at step %d: the %d ranks hold the same %d parameters and buffers (again every %d steps)",
                step,
                self.world_size,
                len(tensors),
                self.every,
            )
        self.passed_at = step


def _diverged(step: int, name: str, values: list[int], count: int, checked: int, passed_at: int | None) -> str:
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    held = "; ".join(
        ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        for ranks in sorted(groups.values(), key=lambda r: (-len(r), r))
    )
    since = (
        f"they agreed at step {passed_at}, so checkpoints after it hold rank 0's copy of a diverged run"
        if passed_at is not None
        else "this is the process's first check"
    )
    return (
        f"the ranks' replicas of the model diverged by step {step}: {name} differs ({len(groups)} values: {held}; "
        f"{count} of {checked} checked tensors differ); {since}. Something updated one rank's copy alone: a "
        "recipe whose forward skips the engine's wrapper (an override of Recipe.training_losses that calls the "
        "module itself: no gradient all-reduce), a nondeterministic kernel, or a faulty device. Fix the cause, then resume from a "
        "checkpoint written before the divergence (train.resume=<its path>)."
    )
