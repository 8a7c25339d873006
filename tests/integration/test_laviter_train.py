"""LAViTeR end to end: the three phases of `python -m vldist.train laviter` from the command line on
a miniature of the embedded scenes (tables, image grid, resumable stages), and on 2 ranks under
torchrun."""

import json
import shutil
import subprocess

import pytest
from helpers import TINY_LAVITER_MODEL, TORCHRUN
from PIL import Image

from vldist.caption import main as caption_main
from vldist.evaluate import main as evaluate_main
from vldist.train import main as train_main

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java")

TINY = [
    *TINY_LAVITER_MODEL,
    "data.batch_size=16",
    "data.eval_batch_size=16",
    "data.shuffle_buffer=64",
    "data.workers=1",
    "eval.examples=2",
    "model.grid=4",
    "metrics.enabled=false",
]


def test_the_job_runs_three_phases_prints_every_metric_and_writes_the_image_grid(scene_splits, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [
        "laviter",
        f"data.shards={scene_splits}",
        f"output.dir={run}",
        "model.vta_epochs=6",
        "model.assist_epochs=1",
        "model.joint_epochs=1",
        "model.vta_trunk=trainable",
        "model.vta_lr=0.002",
        "model.weight_damsm=1",
        *TINY,
    ]
    assert train_main(argv) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0] for line in printed.splitlines() if line.split()}
    assert {"untrained", "pretrain", "vta", "assist", "joint"} <= rows, printed
    for column in ("R-prec@1", "AIMCoS", "i2t R@1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "generated images"):
        assert column in printed, column

    for phase, steps in (("pretrain", 2 * 8), ("vta", 6 * 8), ("assist", 8), ("joint", 8)):
        results = json.loads((run / phase / "metrics.json").read_text())
        assert results["steps"] == steps and results["config"]["model"]["phase"] == phase
    vta = json.loads((run / "vta" / "metrics.json").read_text())
    history = vta["history"]
    assert history[-1]["train_loss"] < 0.9 * history[0]["train_loss"]  # DAMSM learns
    # DAMSM learns retrieval: the validations' rsum (six recalls over every validation caption) rises.
    # The epoch kept is the first with the best R-precision@1, which over this few validation images
    # can tie between all epochs; the first epoch's test rsum can then sit at the untrained model's
    # (seen with other dropout masks), so the test split's rsum is not compared with it.
    validations = [h["val"] for h in history]
    assert validations[-1]["rsum"] > validations[0]["rsum"], validations
    r1 = [v["r_precision1"] for v in validations]
    assert vta["best_epoch"] == history[r1.index(max(r1))]["epoch"]
    # R-precision among the 32 test images, AIMCoS over each scene's objects and attribute words
    assert vta["test"]["candidates"] == 32
    assert -1 <= vta["test"]["aimcos"] <= 1
    joint = json.loads((run / "joint" / "metrics.json").read_text())
    assert joint["test"]["captions"]["bleu4"] >= 0 and "generated_r_precision" in joint["test"]
    grid = run / "joint" / "images" / "test-step-00000008" / "generated-grid.png"
    with Image.open(grid) as picture:
        assert picture.size == (4 * 64 + 5 * 2, 64 + 2 * 2)  # 4 generated images in a row, 2-pixel padding
    assert len(joint["test"]["grid_captions"]) == 4

    # every phase is its own run: asked again with resume, finished phases are not run again and the
    # last resumes from its own checkpoint, with no step left to take
    written = {phase: (run / phase / "metrics.json").stat().st_mtime_ns for phase in ("pretrain", "vta", "assist")}
    assert train_main([*argv, "train.resume=auto"]) == 0
    assert {phase: (run / phase / "metrics.json").stat().st_mtime_ns for phase in written} == written
    assert json.loads((run / "joint" / "metrics.json").read_text())["steps"] == 8

    # the last phase's run evaluates again to the same numbers, and captions a user's image
    assert evaluate_main([str(run / "joint"), "--json"]) == 0
    out = capsys.readouterr().out
    again = json.loads(out[out.index("{") :])
    assert again["r_precision"] == pytest.approx(joint["test"]["r_precision"])
    assert again["aimcos"] == pytest.approx(joint["test"]["aimcos"], abs=1e-6)
    import webdataset as wds

    sample = next(iter(wds.tarfile_samples([{"url": str(sorted(scene_splits.glob("test-*.tar"))[0])}])))
    (tmp_path / "scene.jpg").write_bytes(sample["jpg"])
    assert caption_main([str(run / "joint"), str(tmp_path / "scene.jpg")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{tmp_path / 'scene.jpg'}\t") and line.split("\t")[1]


def test_two_ranks_run_every_phase(scene_splits, tmp_path):
    run = tmp_path / "two"
    proc = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "vldist.train",
            "laviter",
            f"data.shards={scene_splits}",
            f"output.dir={run}",
            "model.pretrain_epochs=1",
            "model.vta_epochs=1",
            "model.assist_epochs=1",
            "model.joint_epochs=1",
            "train.max_steps=3",
            "eval.baseline=false",
            "eval.meteor=false",  # METEOR's JVM: the in-process test above scores it
            "train.validate_every=0",
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for phase in ("pretrain", "vta", "assist", "joint"):
        results = json.loads((run / phase / "metrics.json").read_text())
        assert results["world_size"] == 2 and results["steps"] == 3
        # the logged loss is the global one: every rank's share summed, the same on both
        assert all(entry["train_loss"] > 0 for entry in results["history"])
    assert "R-prec@1" in proc.stdout
