"""The optimizers a run steps, one per named parameter group of its recipe, and their learning-rate
schedules."""

from __future__ import annotations

import math

import torch

from vldist.config import JobConfig


def build_optimizers(config: JobConfig, groups: dict[str, list]) -> dict[str, torch.optim.Optimizer]:
    """One torch optimizer per named group of the recipe (param-group dicts may set their own lr)."""
    t = config.train
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return {name: cls(params, lr=t.lr, weight_decay=t.weight_decay) for name, params in groups.items()}


def build_scheduler(config: JobConfig, optimizer, steps_per_epoch: int, total_steps: int):
    """The lr factor per optimizer step: warm-up, then the paper's step decay or a cosine to 0."""
    t = config.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "cosine":
            progress = (step - t.warmup_steps) / max(total_steps - t.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return t.lr_decay_factor ** (step // (t.lr_decay_epochs * steps_per_epoch))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
