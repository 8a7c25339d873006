"""metrics.trackers: one VSRN run writes TensorBoard event files, an offline W&B run and an MLflow
file store, and each, read back with its own tools, holds the losses, learning rate and throughput
of every progress window, each validation's and the test's numbers, at their steps, as
metrics.jsonl records them. (The captioning table: test_captioner_train.py.)"""

import json

import pytest
from helpers import SMALL_VSRN
from trackers_readback import tensorboard_scalars, tensorboard_texts, wandb_history

from vldist.train import main as train_main

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def test_three_trackers_hold_what_the_run_recorded(planted_shards, tmp_path):
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "vsrn",
                f"data.shards={planted_shards}",
                f"output.dir={run}",
                *SMALL_VSRN,
                "train.epochs=2",
                "train.log_every=3",
                "metrics.trackers=[tensorboard,wandb,mlflow]",
                "metrics.job=tracked",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    validations = [r for r in records if r["event"] == "validation"]
    (test,) = [r for r in records if r["event"] == "test"]
    assert len(train) >= 4 and len(validations) == 2
    results = json.loads((run / "metrics.json").read_text())
    assert test["rsum"] == results["test"]["full"]["rsum"]
    expected = {
        "train/loss": [(r["step"], r["loss"]) for r in train],
        "train/lr": [(r["step"], r["lr"]) for r in train],
        "train/samples_per_second": [(r["step"], r["samples_per_second"]) for r in train],
        "val/rsum": [(r["step"], r["rsum"]) for r in validations],
        "test/rsum": [(test["step"], test["rsum"])],
    }
    trackers = run / "trackers"

    scalars = tensorboard_scalars(trackers / "tensorboard" / "run")
    for tag, points in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag  # float32 in events
    assert "train.lr" in tensorboard_texts(trackers / "tensorboard" / "run")["config"][0][1]

    (run_file,) = (trackers / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    for tag, points in expected.items():
        logged = [(int(row["_step"]), json.loads(row[tag])) for row in history if tag in row]
        assert logged == [(s, pytest.approx(v)) for s, v in points], tag

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(trackers / "mlruns").resolve().as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert mlrun.info.run_name == "run" and mlrun.info.status == "FINISHED"
    assert mlrun.data.params["train.epochs"] == "2"
    for tag, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, tag))
        assert history == [(s, pytest.approx(v)) for s, v in points], tag
