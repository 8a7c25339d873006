"""Small tensor helpers shared by the models."""

from __future__ import annotations

import torch
from torch import nn


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp(min=eps)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of (B, K, D) using only rows where mask (B, K) is True."""
    weights = mask.to(x.dtype).unsqueeze(-1)
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def last_hidden_gru(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The GRU's hidden state after the last valid step of each sequence (padding never read)."""
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    _, hidden = gru(packed)
    return hidden[-1]


def xavier_linear(layer: nn.Linear) -> nn.Linear:
    """VSE++/VSRN's init of the region projection: uniform Xavier weights, zero bias."""
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer
