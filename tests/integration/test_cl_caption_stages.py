"""`python -m vldist.train cl_caption`: the MLE captioner stage, then CL from its best checkpoint."""

import json
import logging
import shutil
import subprocess

import pytest
import yaml
from helpers import TORCHRUN, weights

from vldist.train import main as train_main

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java")

SIZES = {"hidden": 32, "embed": 16, "dropout": 0.1}
DATA = {"batch_size": 20, "eval_batch_size": 30, "shuffle_buffer": 50, "max_regions": 3, "vocab_min_count": 1}


def test_one_command_trains_the_captioner_then_cl_and_prints_both(planted_shards, tmp_path, capsys, caplog):
    captioner_job = tmp_path / "tiny_captioner.yaml"
    captioner_job.write_text(
        yaml.safe_dump(
            {
                "recipe": "captioner",
                "data": DATA,
                "model": SIZES,
                "train": {"epochs": 2, "lr": 0.005, "validate_every": 1},
                "eval": {"self_retrieval_pool": 30, "examples": 1},
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
        "train.lr=0.001",
        "eval.self_retrieval_pool=30",
        "eval.examples=1",
        "metrics.enabled=false",
    ]
    assert train_main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line.split()[0] for line in printed.splitlines() if line.split()[:1] in (["untrained"], ["mle"], ["cl"])]
    assert rows == ["untrained", "mle", "cl"], printed

    mle, cl = (json.loads((out / stage / "metrics.json").read_text()) for stage in ("mle", "cl"))
    assert mle["recipe"] == "captioner" and mle["steps"] == 20 and cl["recipe"] == "cl_caption" and cl["steps"] == 4
    # CL started from the MLE stage's best checkpoint, and its reference never moved from there
    start = weights(out / "mle" / "checkpoints" / "best")
    final = weights(
        out / "cl" / "checkpoints" / "best"
        if (out / "cl" / "checkpoints" / "best").is_dir()
        else sorted((out / "cl" / "checkpoints").glob("step-*"))[-1]
    )
    for name, value in start.items():
        assert (final[f"reference.{name}"] == value).all(), name
    assert any((final[f"target.{name}"] != value).any() for name, value in start.items())

    # again: the finished MLE stage is reused, not trained again
    mle_mtime = (out / "mle" / "metrics.json").stat().st_mtime
    with caplog.at_level(logging.INFO, logger="vldist.train"):
        assert train_main([*argv, "train.resume=auto"]) == 0
    assert "stage 'mle' finished before" in caplog.text
    assert (out / "mle" / "metrics.json").stat().st_mtime == mle_mtime

    # another seed: the finished MLE stage is of other settings, and is neither reused nor redone
    capsys.readouterr()
    assert train_main([*argv, "seed=1"]) == 2
    said = capsys.readouterr().err
    assert (
        f"error: stage 'mle' finished before in {out / 'mle'}, with other settings than this job (1 differ: seed: "
        "the run's 0, this job's 1): only the job that started it carries it on. Start afresh in another "
        f"output.dir or after removing {out / 'mle'}."
    ) in said, said
    assert (out / "mle" / "metrics.json").stat().st_mtime == mle_mtime


@pytest.mark.parametrize(
    "engine",
    [[], ["engine.backend=deepspeed", "engine.deepspeed_config=jobs/deepspeed/zero3.json"]],
    ids=["accelerate", "deepspeed-zero3"],
)
def test_both_stages_run_in_the_same_two_torchrun_ranks(planted_shards, tmp_path, engine):
    """The second stage's engine joins the process group the first one kept (a second rendezvous
    of the same ranks hung). Under ZeRO-3 too, where the frozen reference is partitioned with the
    target: it must still hold the MLE weights at the end."""
    captioner_job = tmp_path / "tiny_captioner.yaml"
    captioner_job.write_text(
        yaml.safe_dump(
            {
                "recipe": "captioner",
                "data": DATA,
                "model": SIZES,
                "train": {"epochs": 1, "lr": 0.005},
                "eval": {"self_retrieval_pool": 30, "meteor": False},  # METEOR: scored in process above
            }
        )
    )
    out = tmp_path / "cl"
    proc = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "vldist.train",
            "cl_caption",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            f"model.captioner_job={captioner_job}",
            *(f"data.{k}={v}" for k, v in DATA.items()),
            *(f"model.{k}={v}" for k, v in SIZES.items()),
            "train.max_steps=2",
            "eval.self_retrieval_pool=30",
            "eval.meteor=false",
            "metrics.enabled=false",
            *engine,
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in ("mle", "cl"):
        assert json.loads((out / stage / "metrics.json").read_text())["world_size"] == 2
    start, final = weights(out / "mle" / "checkpoints" / "best"), weights(out / "cl" / "checkpoints" / "step-00000002")
    for name, value in start.items():
        assert (final[f"reference.{name}"] == value).all(), name
    assert any((final[f"target.{name}"] != value).any() for name, value in start.items())
