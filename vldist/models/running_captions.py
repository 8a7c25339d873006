"""Teacher forcing over captions of different lengths, on CPU: each step runs only the captions
that still have a word to predict.

A padded caption's trailing positions predict padding, which the caption losses ignore
(`cross_entropy(..., ignore_index=pad)`), so the recurrence over them is work nobody reads: with
the embedded captions (4-24 words, mean 11.6) about half of a decoder's steps. Here the rows run
longest first, step t runs the first `running[t]` of them (those whose target tokens[:, t + 1] is
no padding, or is followed by a word), and each step's output is zero on the rows that stopped.
Every position the loss reads is the full batch's value: only finished rows' padding changes.

On accelerators and under torch.compile the full batch runs instead: shapes stay static (CUDA
graphs, no recompiles) and no lengths are read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RunningCaptions:
    order: Tensor | None  # (B,) the batch's rows, longest caption first; None: already in that order
    running: list[int]  # per step t: how many rows (of `order`) still predict a word, non-increasing

    def sort(self, x: Tensor) -> Tensor:
        """A per-row tensor (B, ...) in running order."""
        return x if self.order is None else x.index_select(0, self.order)

    def unsort(self, x: Tensor, dim: int) -> Tensor:
        """A tensor in running order along `dim` back in the batch's row order."""
        return x if self.order is None else x.index_select(dim, torch.argsort(self.order))


def running_captions(tokens: Tensor, pad_id: int = 0) -> RunningCaptions | None:
    """How the teacher-forced steps over `tokens` (B, T) shrink, or None where the full batch
    should run (not on CPU, under compile, or when every caption runs to the last step)."""
    if tokens.device.type != "cpu" or torch.compiler.is_compiling() or tokens.shape[1] < 2:
        return None
    # a row's steps: up to its last target that is a word (targets are tokens[:, 1:])
    positions = torch.arange(1, tokens.shape[1])
    steps = torch.where(tokens[:, 1:] != pad_id, positions, 0).amax(dim=1)
    if int(steps.min()) == tokens.shape[1] - 1:
        return None
    ordered, order = steps.sort(descending=True, stable=True)
    # rows still running at step t: those with more than t steps
    running = (ordered[None, :] > torch.arange(tokens.shape[1] - 1)[:, None]).sum(dim=1).tolist()
    in_order = bool(torch.equal(order, torch.arange(len(order))))
    return RunningCaptions(None if in_order else order, running)
