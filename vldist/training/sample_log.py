"""train.sample_log: the identities (data/identity.py) of the samples each rank trains on, one
JSON line per optimizer step in <output.dir>/samples/rank-R.jsonl, appended across resumes. With
it a run can be audited: over an exact epoch, interrupted and resumed on any number of ranks,
every sample's identity appears once (tests/integration/test_exact_data.py counts them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class SampleLog:
    def __init__(self, enabled: bool, out_dir: Path, rank: int):
        self.path = out_dir / "samples" / f"rank-{rank}.jsonl" if enabled else None

    def record(self, epoch: int, step: int, batches: list[dict]) -> None:
        """The step's micro-batches, after the step (a step never taken is never logged)."""
        if self.path is None:
            return
        identities = [int(i) for b in batches for i in torch.as_tensor(b["identity"]).tolist()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "identity": identities}) + "\n")
