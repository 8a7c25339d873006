"""What some recipes can do besides training and evaluating, as Protocols: `python -m
vldist.caption` captions a user's images with a recipe that has one of them; the trainer keeps
every negative of an accumulated step with one that caches negatives."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CaptionsRegions(Protocol):
    """Captions images from their region features (the captioners)."""

    def caption(self, model: nn.Module, regions: list, device: torch.device) -> list[str]: ...


@runtime_checkable
class CaptionsPixels(Protocol):
    """Captions images from their pixels, `Recipe.images_per_caption` at a time (L2C: pairs)."""

    def caption_pixels(self, model: nn.Module, images: list, device: torch.device) -> list[str]: ...


@runtime_checkable
class CachesNegatives(Protocol):
    """Accumulates micro-batches without losing the global batch's negatives
    (train.accumulate_negatives, training/negative_cache.py runs the step). The recipe splits its
    loss into a cross-batch term, computed once over the embeddings of every micro-batch of the
    rank (gathered across ranks as usual), and terms of each micro-batch alone."""

    def negatives_refusal(self) -> str:
        """Why this recipe's configuration cannot accumulate so ("" when it can)."""
        ...

    def cross_batch_embeddings(self, outputs: Any) -> dict[str, torch.Tensor]:
        """The forward outputs the cross-batch loss reads, batch-first."""
        ...

    def joined_batch(self, batches: list[dict]) -> dict:
        """The fields the cross-batch loss reads (identity, row indices) of the rank's micro-batches
        as one batch: their embeddings are concatenated in the same order."""
        ...

    def cross_batch_losses(self, embeddings: dict[str, torch.Tensor], batch: dict) -> dict[str, torch.Tensor]:
        """{'loss': this rank's share of the cross-batch loss of the global batch, <component>:
        detached parts}, from the rank's embeddings of all its micro-batches (`joined_batch`)."""
        ...

    def micro_batch_losses(self, outputs: Any, batch: dict) -> dict[str, torch.Tensor]:
        """The terms that decompose over micro-batches, as `Recipe.losses` computes them on one
        micro-batch alone ({} when there are none); `micro_batch_weight` weighs them."""
        ...

    def micro_batch_weight(self, batch: dict) -> int:
        """What those terms average over in this micro-batch on this rank (captions, real tokens):
        micro-batch k's terms count in proportion to its global weight."""
        ...


def joined_rows(batches: list[dict], *fields: str) -> dict[str, torch.Tensor]:
    """The per-row tensor `fields` of the micro-batches concatenated (those every batch has): a
    CachesNegatives recipe's `joined_batch` for fields such as `identity`."""
    return {f: torch.cat([b[f] for b in batches]) for f in fields if all(f in b for b in batches)}
