"""Both two-branch recipes on a CUDA GPU under bf16 autocast (skipped without one): both tasks
train with finite losses and evaluate."""

import json
import math

import pytest
import torch

from vldist.shards.synthetic.synth import build_synth
from vldist.train import main as train_main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("job", ["two_branch_embed", "two_branch_sim"])
def test_both_tasks_train_on_cuda_in_bf16(tmp_path, job):
    build_synth(tmp_path / "synth", n_train=80, n_val=16, n_test=24, feature_size=32, progress=False)
    run = tmp_path / "run"
    assert (
        train_main(
            [
                job,
                f"data.shards={tmp_path / 'synth'}",
                f"output.dir={run}",
                "model.hidden=32",
                "model.embed=16",
                "data.batch_size=20",
                "data.eval_batch_size=24",
                "train.epochs=2",
                "train.device=cuda",
                "engine.mixed_precision=bf16",
                "metrics.enabled=false",
            ]
        )
        == 0
    )
    for task in ("retrieval", "phrases"):
        metrics = json.loads((run / task / "metrics.json").read_text())
        assert metrics["config"]["engine"]["mixed_precision"] == "bf16"
        assert all(math.isfinite(h["train_loss"]) for h in metrics["history"]), task
    phrases = json.loads((run / "phrases" / "metrics.json").read_text())["test"]["phrases"]
    assert 0 <= phrases["r1"] <= 100 and phrases["n_phrases"] > 0
