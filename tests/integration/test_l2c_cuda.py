"""L2C on a CUDA GPU under bf16 autocast (skipped without one): both stages train with finite
losses, evaluate, and draw their pictures."""

import json
import math
import shutil

import pytest
import torch
from helpers import write_scene_images

from vldist.shards.synthetic.pairs import build_synth_pairs
from vldist.train import main as train_main

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java"),
]


def test_both_stages_train_on_cuda_in_bf16(tmp_path):
    build_synth_pairs(tmp_path / "pairs", n_train=32, n_val=8, n_test=8, shard_size=16, image_size=64, progress=False)
    singles = write_scene_images(tmp_path / "singles", {"train": 32})
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "l2c",
                f"data.shards={tmp_path / 'pairs'}",
                f"model.single_shards={singles}",
                f"output.dir={run}",
                "model.image_size=64",
                "model.graph_dim=32",
                "model.hidden=32",
                "model.embed=16",
                "data.batch_size=8",
                "model.single_batch_size=8",
                "train.epochs=2",
                "train.device=cuda",
                "engine.mixed_precision=bf16",
                "metrics.enabled=false",
            ]
        )
        == 0
    )
    for stage in ("cnn_lstm", "l2c"):
        metrics = json.loads((run / stage / "metrics.json").read_text())
        assert metrics["config"]["engine"]["mixed_precision"] == "bf16"
        assert all(math.isfinite(h["train_loss"]) for h in metrics["history"]), stage
    assert list((run / "l2c" / "images").glob("test-*/*.png"))
