"""Caption generation loss L_G (VSRN Eq. 9): negative log-likelihood of the reference words."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def caption_nll(logits: torch.Tensor, targets: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """Mean NLL per real target token. logits (B, T, V), targets (B, T); pad positions are ignored.

    The paper writes a sum over time steps; the official code averages over the masked tokens,
    which keeps L_G on the scale of one word whatever the caption length. We follow the code.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=pad_id)
