"""The trackers' refusals (a missing package, a credential in the MLflow URI) and what a progress
record becomes (its finite numbers, scoped by event, at its step)."""

import importlib.util

import pytest

from vldist.config import JobConfig
from vldist.errors import ConfigError
from vldist.telemetry import trackers
from vldist.telemetry.trackers import Trackers, check_installed


class Recording:
    def __init__(self):
        self.calls = []

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def table(self, name, columns, rows, step):
        self.calls.append(("table", name, columns, rows, step))


def test_a_record_becomes_its_finite_numbers_under_its_scope():
    sink = Recording()
    t = Trackers([sink])
    t.record(
        {
            "event": "train",
            "epoch": 1,
            "step": 6,
            "loss": 2.5,
            "lr": 1e-3,
            "straggler": "rank 1 ...",
            "grad_norm": float("nan"),
        }
    )
    t.record({"event": "validation", "epoch": 1, "step": 6, "rsum": 300.0})
    t.record({"event": "stopped", "step": 7, "reason": "SIGTERM"})  # not a number series
    t.examples("test", 9, [{"key": 3, "generated": "a red | square", "references": ["a red square", "red"]}])
    assert sink.calls == [
        ("log", {"train/loss": 2.5, "train/lr": 1e-3}, 6),
        ("log", {"val/rsum": 300.0}, 6),
        (
            "table",
            "captions/test",
            ["image", "generated", "references"],
            [["3", "a red | square", "a red square | red"]],
            9,
        ),
    ]


def test_a_failing_tracker_does_not_stop_training(caplog):
    class Broken:
        def log(self, values, step):
            raise OSError("disk full")

    Trackers([Broken()]).record({"event": "train", "step": 1, "loss": 1.0})
    assert "Broken: log failed (disk full); training goes on" in caplog.text


def test_a_missing_package_is_refused_with_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(
        ConfigError,
        match=r"lists wandb, but its package is not installed: pip install 'wandb' "
        r"\(or pip install 'vldist\[trackers\]'",
    ):
        check_installed(["tensorboard", "wandb"])


def test_an_mlflow_uri_with_a_credential_is_refused():
    with pytest.raises(ValueError, match="carries user:password@.*MLFLOW_TRACKING_TOKEN"):
        JobConfig.model_validate({"recipe": "vsrn", "metrics": {"mlflow_tracking_uri": "https://me:pw@mlflow.example"}})
    assert JobConfig.model_validate({"recipe": "vsrn", "metrics": {"mlflow_tracking_uri": "https://mlflow.example"}})
