"""The captioning recipes on a CUDA GPU under bf16 autocast (skipped without one): the MLE stage
and CL train with finite losses, CL's frozen reference keeps the MLE weights, and generation and
the caption metrics run on the GPU's outputs."""

import json
import logging
import math
import shutil

import pytest
import torch
import yaml
from helpers import weights

from vldist.train import main as train_main

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java"),
]

SIZES = {"hidden": 32, "embed": 16}
DATA = {"batch_size": 20, "eval_batch_size": 30, "shuffle_buffer": 50, "max_regions": 3, "vocab_min_count": 1}


def test_cl_caption_trains_both_stages_on_cuda_in_bf16(planted_shards, tmp_path, caplog):
    captioner_job = tmp_path / "tiny_captioner.yaml"
    captioner_job.write_text(
        yaml.safe_dump(
            {
                "recipe": "captioner",
                "data": DATA,
                "model": SIZES,
                "train": {"epochs": 2, "lr": 0.005},
                "eval": {"self_retrieval_pool": 30},
            }
        )
    )
    out = tmp_path / "cl"
    argv = [
        "cl_caption",
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        f"model.captioner_job={captioner_job}",
        *(f"data.{k}={v}" for k, v in DATA.items()),
        *(f"model.{k}={v}" for k, v in SIZES.items()),
        "train.max_steps=4",
        "train.device=cuda",
        "engine.mixed_precision=bf16",
        "eval.self_retrieval_pool=30",
        "metrics.enabled=false",
    ]
    with caplog.at_level(logging.INFO, logger="vldist"):
        assert train_main(argv) == 0
    assert "(cuda x 1)" in caplog.text
    for stage in ("mle", "cl"):
        metrics = json.loads((out / stage / "metrics.json").read_text())
        assert metrics["config"]["engine"]["mixed_precision"] == "bf16"
        assert all(math.isfinite(h["train_loss"]) for h in metrics["history"]), stage
        assert math.isfinite(metrics["test"]["captions"]["cider_d"])
    start, final = weights(out / "mle" / "checkpoints" / "best"), weights(out / "cl" / "checkpoints" / "step-00000004")
    for name, value in start.items():
        assert (final[f"reference.{name}"] == value).all(), name
