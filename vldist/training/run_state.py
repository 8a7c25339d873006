"""What a run has done so far, besides its weights and optimizers: checkpointed with them, so that
a resumed run carries on exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RunState:
    step: int = 0
    epoch: int = 0  # the epoch in progress (0-based)
    epoch_step: int = 0  # batches of that epoch already taken: the data position
    data_position: dict = field(default_factory=dict)  # the same, per stream in samples (streams.data_position)
    epoch_loss_sum: float = 0.0
    samples_seen: int = 0
    samples_by_source: dict = field(default_factory=dict)  # data.sources: samples trained on from each
    skipped_samples: int = 0
    epoch_skipped: int = 0  # of the epoch in progress: data.max_skipped_fraction bounds it
    skipped_by_shard: dict = field(default_factory=dict)  # the run's skipped samples by shard, at epochs' ends
    best_score: float = -math.inf
    best_epoch: int | None = None
    history: list[dict] = field(default_factory=list)
    untrained: dict | None = None
    restarts: int = 0
