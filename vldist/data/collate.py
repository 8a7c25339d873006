"""Padding helpers for collate functions."""

from __future__ import annotations

import numpy as np
import torch

from vldist.data.batch_handoff import batch_tensor


def pad_regions(features: list[np.ndarray], max_regions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_i, F) arrays -> regions (B, K, F) float32 with zero padding, mask (B, K) True for real rows."""
    dim = features[0].shape[1]
    regions = batch_tensor((len(features), max_regions, dim))
    mask = torch.zeros(len(features), max_regions, dtype=torch.bool)
    for i, f in enumerate(features):
        n = min(len(f), max_regions)
        # torch's copy converts float16 rows to float32 with vector instructions; numpy's
        # astype took 5x as long on the shards' float16 features
        regions[i, :n].copy_(torch.from_numpy(f[:n]))
        regions[i, n:].zero_()
        mask[i, :n] = True
    return regions, mask


def concat_rows(arrays: list[np.ndarray], dim: int) -> torch.Tensor:
    """(N_i, F) arrays of any float dtype -> their rows one after another, (sum N_i, F) float32."""
    rows = batch_tensor((sum(len(a) for a in arrays), dim))
    return torch.cat([torch.from_numpy(a).reshape(-1, dim) for a in arrays], out=rows)


def pad_tokens(
    sequences: list[list[int]], pad_id: int = 0, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Id lists -> tokens (B, T) padded with pad_id, lengths (B,). T is the longest sequence, or
    `length` when every batch must have the same shape."""
    lengths = torch.tensor([len(s) for s in sequences])
    tokens = torch.full((len(sequences), length or int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens, lengths
