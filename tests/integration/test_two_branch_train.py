"""Both two-branch recipes from the command line on a small synthetic set with proposals: one
job trains a retrieval model and a phrase-localisation model and prints both beside the untrained
models and chance; under torchrun and DeepSpeed too."""

import json
import subprocess

import pytest
from helpers import TORCHRUN

from vldist.evaluate import main as evaluate_main
from vldist.shards.synthetic.synth import build_synth
from vldist.train import main as train_main

TINY = [
    "model.hidden=64",
    "model.embed=32",
    "model.dropout=0.1",
    "data.batch_size=40",
    "data.eval_batch_size=40",
    "data.shuffle_buffer=100",
    "model.tasks=[retrieval,phrases]",
    "train.lr=0.003",
    "train.lr_decay_epochs=100",
    "metrics.enabled=false",
]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_branch") / "synth"
    build_synth(out, n_train=200, n_val=40, n_test=60, feature_size=32, progress=False)
    return out


@pytest.mark.parametrize("job", ["two_branch_embed", "two_branch_sim"])
def test_trains_both_tasks_and_reports_them_beside_untrained_and_chance(synth, tmp_path, capsys, job):
    run = tmp_path / "run"
    # data.workers=0: this process reads the 5 batches of an epoch itself; two loader workers forked
    # for each of the 24 epochs and 28 evaluations took about half of the test's time
    args = [f"data.shards={synth}", f"output.dir={run}", "train.epochs=12", *TINY, "data.workers=0"]
    assert train_main([job, *args]) == 0
    printed = capsys.readouterr().out
    assert "i2t R@1" in printed and "phrase localisation:" in printed
    lines = printed.splitlines()
    for row, count in (("chance", 2), ("untrained", 2), ("retrieval", 1), ("phrases", 1)):
        assert sum(line.split()[:1] == [row] for line in lines) == count, printed  # in each table

    # one model per task, each its own run (stage) under output.dir
    retrieval, phrases = (json.loads((run / task / "metrics.json").read_text()) for task in ("retrieval", "phrases"))
    assert retrieval["config"]["model"]["tasks"] == ["retrieval"] and "phrases" not in retrieval["test"]
    assert phrases["config"]["model"]["tasks"] == ["phrases"] and "full" not in phrases["test"]
    found = phrases["test"]["phrases"]
    assert found["n_phrases"] >= 60  # 60 test images of 1-4 objects, each a phrase
    # seeds 0-2 of this job give R@1 24-36 against chance's 11.7 (two_branch_sim; embed 37-48). With 8 epochs
    # they gave 19-30 until a fresh install (torch 2.14.1, numpy 2.4.6, Pillow 13.0.0, scikit-learn 1.9.1)
    # moved seed 0 to 15.6: the margin needs the longer run. With data.workers=0 (another draw of the
    # batches: a stream per loader worker), seeds 0-2 gave 26.5-35.4 (sim) and 40.1-43.5 (embed), the
    # rsum 109-151 against an untrained 43-61 (2026-11-27)
    assert found["r1"] > max(found["chance"]["r1"], phrases["untrained"]["phrases"]["r1"]) + 5, found
    assert retrieval["test"]["full"]["rsum"] > retrieval["untrained"]["full"]["rsum"] + 30
    assert ("sentence_to_sentence" in retrieval["test"]) == (job == "two_branch_embed")

    assert evaluate_main([str(run / "phrases")]) == 0  # the saved run evaluates alike (tf-idf in the checkpoint)
    again = capsys.readouterr().out
    assert "phrase localisation:" in again and f"{found['r1']:.1f}" in again


@pytest.mark.parametrize(
    "engine",
    [[], ["engine.backend=deepspeed", "engine.deepspeed_config=jobs/deepspeed/zero2.json"]],
    ids=["ddp", "deepspeed-zero2"],
)
def test_two_torchrun_ranks_train_both_tasks(synth, tmp_path, engine):
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "vldist.train",
            "two_branch_embed",
            f"data.shards={synth}",
            f"output.dir={run}",
            "train.epochs=3",
            "engine.sync_batchnorm=true",
            *TINY,
            *engine,
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for task in ("retrieval", "phrases"):
        results = json.loads((run / task / "metrics.json").read_text())
        assert results["world_size"] == 2 and results["steps"] == 3 * 5  # 3 epochs x 200 / 40
        losses = [h["train_loss"] for h in results["history"]]
        assert losses[-1] < losses[0], (task, losses)
