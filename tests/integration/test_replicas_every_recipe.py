"""Every built-in recipe, every stage of its job, on 2 gloo ranks under Accelerate and DeepSpeed
ZeRO-2: the replica check passes after the first update and after every step, and the ranks end
with the same weights, compared here tensor by tensor (independently of the check's hash)."""

from pathlib import Path

import pytest
import torch
from helpers import TORCHRUN

from vldist.shards.synthetic.synth import build_synth

WORKER = Path(__file__).parent / "workers" / "every_recipe_in_step.py"
# stages each job runs: CL trains its captioner first, L2C its baseline, LAViTeR its phases
STAGES = {
    "vsrn": ["vsrn"],
    "captioner": ["captioner"],
    "cl_caption": ["mle", "cl"],
    "two_branch_embed": ["two_branch_embed"],
    "two_branch_sim": ["two_branch_sim"],
    "l2c": ["cnn_lstm", "l2c"],
    "laviter": ["pretrain", "vta", "assist", "joint"],
}


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "shards"
    build_synth(out, n_train=32, n_val=8, n_test=8, feature_size=32, progress=False)
    return out


@pytest.mark.parametrize("engine", ["accelerate", "zero2"])
def test_every_recipe_keeps_its_replicas_in_step(
    engine, planted_shards, small_synth, pair_shards, scene_images, scene_splits, tmp_path
):
    import subprocess

    proc = subprocess.run(
        [
            *TORCHRUN,
            str(WORKER),
            str(tmp_path),
            engine,
            str(planted_shards),
            str(small_synth),
            str(pair_shards),
            str(scene_images),
            str(scene_splits),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    checked = out.count("replica check at step 1: the 2 ranks hold the same")
    assert checked == sum(map(len, STAGES.values())), out[-4000:]  # every stage checked after its first update
    for job, stages in STAGES.items():
        for stage in stages:
            ranks = [
                torch.load(tmp_path / f"{recipe}.{stage}.rank{r}.pt", weights_only=True)
                for r in (0, 1)
                for recipe in [_recipe_of(job, stage)]
            ]
            assert ranks[0].keys() == ranks[1].keys() and ranks[0], (job, stage)
            differing = [k for k in ranks[0] if not torch.equal(ranks[0][k], ranks[1][k])]
            assert not differing, (job, stage, differing[:3])


def _recipe_of(job: str, stage: str) -> str:
    return {"mle": "captioner", "cnn_lstm": "l2c"}.get(stage, job)
