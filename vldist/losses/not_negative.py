"""Which pairs of a global batch are never negatives: those of one image (data/identity.py).

Each cross-batch loss gathers the samples' identities beside their embeddings and masks every pair
of equal identity out of its negatives, as it already masks each row's own positive.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vldist.distributed.collectives import all_gather_rows


def same_identity(rows: Tensor, columns: Tensor) -> Tensor:
    """(len(rows), len(columns)) bool: True where the row's and the column's images are one."""
    return rows.to(columns.device)[:, None] == columns[None, :]


def local_identities(identity: Tensor | None, count: int, device: torch.device) -> Tensor:
    """The identities of this rank's `count` rows; without any (a caller that has none), each row
    its own image, numbered by its global row so that ranks never share a number."""
    if identity is not None:
        if identity.shape != (count,):
            raise ValueError(f"identity must hold one id per sample, shape ({count},); got {tuple(identity.shape)}")
        return identity.to(device=device, dtype=torch.long)
    counts, first = all_gather_rows(torch.tensor([count], device=device))
    return torch.arange(count, device=device) + int(counts[:first].sum())


def gather_identities(identity: Tensor | None, count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(this rank's identities (count,), every rank's in rank order (B_global,)), the order of
    `all_gather_with_grad`'s rows."""
    mine = local_identities(identity, count, device)
    return mine, all_gather_rows(mine)[0]


def other_image_rows(identity: Tensor) -> Tensor:
    """(B,) for each row the nearest row after it (cyclically) of another image: the row roll(1)
    picks when that is another image, as a GAN's mismatched-text pair wants, never a copy."""
    n = identity.shape[0]
    steps = torch.arange(1, n, device=identity.device)  # try i+1, i+2, ... in turn
    candidates = (torch.arange(n, device=identity.device)[:, None] + steps[None, :]) % n  # (B, B-1)
    other = identity[candidates] != identity[:, None]
    if n < 2 or not bool(other.any(dim=1).all()):
        raise ValueError(
            f"a batch of {n} rows holds no other image for some row: mismatched pairs need at least "
            "two different images per rank (raise data.batch_size)"
        )
    return candidates.gather(1, other.float().argmax(dim=1, keepdim=True)).squeeze(1)
