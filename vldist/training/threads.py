"""How many threads torch's CPU operators use in the training process.

train.threads sets it; without it, torch's own default stays (one thread per core).
"""

from __future__ import annotations

import torch


def set_torch_threads(threads: int | None) -> int:
    """Apply train.threads (None: keep torch's choice); returns the count in use."""
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
