"""When `python -m vldist.train` hands the job to Ray, and the config its workers get."""

from pathlib import Path

import pytest

from vldist.launch import ray_train
from vldist.recipes.jobs import load_config


@pytest.mark.parametrize(
    "launcher, env, expected",
    [
        ("auto", {}, False),
        ("auto", {"RAY_ADDRESS": "127.0.0.1:6379"}, True),  # the driver of `ray job submit`
        ("auto", {"RAY_ADDRESS": "127.0.0.1:6379", "RANK": "1"}, False),  # a torchrun rank inside a Ray job
        ("local", {"RAY_ADDRESS": "127.0.0.1:6379"}, False),
        ("ray", {}, True),
    ],
)
def test_ray_is_used_inside_a_ray_job_or_when_asked(monkeypatch, launcher, env, expected):
    for key in ("RAY_ADDRESS", "RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ray_train.wanted(load_config("vsrn", [f"launcher={launcher}"])) is expected


def test_workers_get_absolute_paths_and_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config("vsrn", ["launcher=ray", "data.shards=data/coco", "ray.storage_path=runs", "ray.name={recipe}-a"])
    worker = ray_train.worker_config(config)
    assert worker.data.shards == str(tmp_path / "data" / "coco")
    assert worker.output_dir == tmp_path / "runs" / "vsrn-a"
    assert worker.launcher == "local"  # a worker runs the job itself, never launches Ray again
    assert Path(config.data.shards) == Path("data/coco")  # the driver's own config is left alone
