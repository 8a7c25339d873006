"""LAViTeR on a CUDA GPU under bf16 autocast (skipped without one): the three phases train with
finite losses (DAMSM and the GAN's losses run in float32 inside), evaluate and write the grid."""

import json
import math
import shutil

import pytest
import torch
from helpers import write_scene_images
from test_laviter_train import TINY

from vldist.train import main as train_main

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java"),
]


def test_three_phases_train_on_cuda_in_bf16(tmp_path):
    shards = write_scene_images(tmp_path / "scenes", {"train": 64, "val": 16, "test": 16})
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "laviter",
                f"data.shards={shards}",
                f"output.dir={run}",
                "model.vta_epochs=2",
                "model.assist_epochs=1",
                "model.joint_epochs=1",
                "train.device=cuda",
                "engine.mixed_precision=bf16",
                *TINY,
            ]
        )
        == 0
    )
    for phase in ("pretrain", "vta", "assist", "joint"):
        metrics = json.loads((run / phase / "metrics.json").read_text())
        assert metrics["config"]["engine"]["mixed_precision"] == "bf16"
        assert all(math.isfinite(h["train_loss"]) for h in metrics["history"]), phase
    assert list((run / "joint" / "images").glob("test-*/generated-grid.png"))
