"""Dropout whose CPU masks come from one uniform draw instead of `bernoulli_`.

On the CPU, torch's `bernoulli_(p)` (what `F.dropout` draws its mask with) takes MKL's vectorised
generator only on Intel processors; elsewhere it samples element by element: on the project's
AMD EPYC host the dropout of VSRN's decoder states (25 x 128 x 256, p 0.1, forward and backward)
took 6.2 ms against 3.6 ms with this mask (`python bench/cpu_dropout.py`; docs/performance.md,
"Dropout on the CPU"). The mask is the same distribution: an element is kept with probability
1 - p (a uniform draw in [0, 1) at or above p) and scaled by 1 / (1 - p).

`uniform_` fills a CPU tensor serially from the generator, in order (the draw is contiguous), so a
draw over (T, B, H) takes exactly the masks of T draws over (B, H): a decoder that drops out all of
its steps' hidden states at once keeps the masks of its per-token reference, on every CPU and with
any number of threads. On other devices (CUDA's fused dropout kernel) and in evaluation this is
`F.dropout`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout(x, p, training)`, with the CPU's mask drawn as `rand >= p`."""
    if not training or p == 0.0 or x.device.type != "cpu":
        return F.dropout(x, p, training)
    if p == 1.0:
        return x * 0.0
    draw = torch.rand(x.shape, device=x.device)
    # As F.dropout on the CPU: the mask in x's dtype, divided by 1 - p, times x (autograd keeps the
    # scaled mask for the backward, and the gradient is the same product). In fp32 the draw becomes
    # the mask in place: one buffer, not three, each a fresh allocation's page faults at these sizes.
    if x.dtype == torch.float32:
        mask = draw.ge_(p).div_(1.0 - p)
    else:
        mask = (draw >= p).to(x.dtype).div_(1.0 - p)
    return x * mask


class Dropout(nn.Dropout):
    """`nn.Dropout` with `dropout`'s CPU mask; the same module otherwise (no state, same repr)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)


def use_uniform_dropout_masks(model: nn.Module) -> int:
    """Replace, in place, every `nn.Dropout` of `model` (also those inside torch's own layers, such
    as nn.TransformerEncoderLayer's) with `Dropout` of the same p; returns how many. Dropout has no
    parameters or buffers: state_dict keys and checkpoints are unchanged."""
    # exactly nn.Dropout: a subclass may draw its masks its own way
    return replace_dropout(model, lambda m: Dropout(m.p, m.inplace), only=lambda m: type(m) is nn.Dropout)


def replace_dropout(
    model: nn.Module,
    make: Callable[[nn.Dropout], nn.Module],
    only: Callable[[nn.Dropout], bool] = lambda m: True,
) -> int:
    """Replace, in place, each `nn.Dropout` (subclasses included) that `only` accepts with `make(it)`,
    in the mode it was in; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Dropout) and only(child):
                setattr(parent, name, make(child).train(child.training))
                replaced += 1
    return replaced
