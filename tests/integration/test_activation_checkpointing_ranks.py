"""train.activation_checkpointing=true in real training: 2 steps of `python -m vldist.train` on 2
gloo ranks under DDP (Accelerate) and DeepSpeed ZeRO-2, the replica check after every step (the
ranks' weights and, with engine.sync_batchnorm, batch-norm statistics, compared tensor by tensor
here too), and the log naming the checkpointed blocks. VSRN: RRR layers whose global batch norm
all-reduces again in the recompute inside the backward, and a decoder checkpointed per step. The
step equivalence, recipe by recipe, is the unit test's."""

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import TORCHRUN

WORKER = Path(__file__).parent / "workers" / "every_recipe_in_step.py"
JOBS = {"accelerate": "vsrn", "zero2": "vsrn"}


@pytest.mark.parametrize("engine", list(JOBS))
def test_two_ranks_train_with_activation_checkpointing_and_stay_in_step(engine, planted_shards, tmp_path):
    unused = str(tmp_path / "unused")  # the sets of the jobs not run
    proc = subprocess.run(
        [
            *TORCHRUN,
            str(WORKER),
            str(tmp_path),
            engine,
            str(planted_shards),
            str(planted_shards),
            unused,
            unused,
            unused,
            JOBS[engine],
            "train.activation_checkpointing=true",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    blocks = "5 blocks recomputed in the backward: image.rrr.0, image.rrr.1, image.rrr.2, image.rrr.3, decoder"
    assert f"train.activation_checkpointing: {blocks}" in out, out[-4000:]
    jobs = JOBS[engine].split(",")
    assert out.count("replica check at step 1: the 2 ranks hold the same") == len(jobs), out[-4000:]
    for job in jobs:
        ranks = [torch.load(tmp_path / f"{job}.{job}.rank{r}.pt", weights_only=True) for r in (0, 1)]
        assert ranks[0].keys() == ranks[1].keys() and ranks[0]
        assert not [k for k in ranks[0] if not torch.equal(ranks[0][k], ranks[1][k])], job
