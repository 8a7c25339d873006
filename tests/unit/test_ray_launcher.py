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
    config = load_config(
        "vsrn", ["launcher=ray", "data.shards=data/coco", "ray.storage_path=runs", "ray.name={recipe}-a"]
    )
    worker = ray_train.worker_config(config)
    assert worker.data.shards == str(tmp_path / "data" / "coco")
    assert worker.output_dir == tmp_path / "runs" / "vsrn-a"
    assert worker.launcher == "local"  # a worker runs the job itself, never launches Ray again
    assert Path(config.data.shards) == Path("data/coco")  # the driver's own config is left alone


def test_an_embedded_set_keeps_its_name_for_each_worker_to_resolve_where_it_runs(tmp_path, monkeypatch):
    """The driver's own directory may not exist on other nodes: a worker reads (or builds) an
    embedded set in the job's working directory on its node. L2C reads two."""
    monkeypatch.chdir(tmp_path)
    assert ray_train.worker_config(load_config("vsrn", ["launcher=ray"])).data.shards == "shards/synth"
    l2c = ray_train.worker_config(load_config("l2c", ["launcher=ray"]))
    assert (l2c.data.shards, l2c.model.single_shards) == ("shards/synth_pairs", "shards/synth")
    # not built where read: a path like any other
    fixed = ray_train.worker_config(load_config("vsrn", ["launcher=ray", "data.build_if_missing=false"]))
    assert fixed.data.shards == str(tmp_path / "shards" / "synth")


@pytest.mark.parametrize(("given", "expected"), [("3", (3, 3)), ("1:2", (1, 2)), ("2:2", (2, 2)), ("2:8", (2, 8))])
def test_a_worker_count_or_an_elastic_range(given, expected):
    assert load_config("vsrn", [f"ray.num_workers={given}"]).ray.worker_range == expected


@pytest.mark.parametrize("given", ["0", "2:1", "a", "1:2:3", "0:2"])
def test_a_bad_worker_range_is_refused_by_name(given):
    from vldist.errors import ConfigError

    with pytest.raises(ConfigError, match=f"'{given}' is neither a number of workers"):
        load_config("vsrn", [f"ray.num_workers={given}"])


def test_every_size_of_an_elastic_range_must_split_the_global_batch():
    from vldist.errors import ConfigError

    ray_train.check_batch_splits(load_config("vsrn", ["data.batch_size=24", "ray.num_workers=1:4"]), 1, 4)
    config = load_config("vsrn", ["data.batch_size=32", "ray.num_workers=2:6"])
    with pytest.raises(ConfigError, match="data.batch_size=32 .* cannot be split over 3, 5, 6 workers"):
        ray_train.check_batch_splits(config, *config.ray.worker_range)


def test_colon_values_are_strings_not_yaml_base_60_numbers():
    from vldist.config import load_yaml, parse_overrides

    assert parse_overrides(["ray.num_workers=1:2"]) == {"ray": {"num_workers": "1:2"}}  # YAML 1.1 says 62
    assert [load_yaml(v) for v in ["0.5", "-3", "0x10", ".inf", "1_000", "true"]] == [
        0.5,
        -3,
        16,
        float("inf"),
        1000,
        True,
    ]


def test_a_stop_signal_to_the_driver_is_posted_on_the_board_and_the_handler_restored():
    """The handler only notes the signal; the relay thread posts it (a Ray call in a handler could
    re-enter Ray). A small fake stands for the board actor's handle."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    posted = []
    board = SimpleNamespace(request_stop=SimpleNamespace(remote=posted.append))
    before = signal.getsignal(signal.SIGUSR1)
    with ray_train.relay_stop_signals(["SIGUSR1"], board):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 10
        while not posted and time.time() < deadline:
            time.sleep(0.01)
    assert posted == ["SIGUSR1"]
    assert signal.getsignal(signal.SIGUSR1) is before
    with ray_train.relay_stop_signals(["SIGUSR1"], board):
        pass  # no signal: nothing posted, and the relay thread ends with the block
    assert posted == ["SIGUSR1"]


def test_the_controller_polls_the_workers_every_half_second_unless_the_user_chose():
    """Ray Train reads the poll interval under that name and carries it from the driver to its
    controller; vldist's 0.5 s replaces Ray's 2 s only where the environment has none."""
    pytest.importorskip("ray")
    from ray.train.v2._internal import constants

    name = constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    assert name == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" and name in constants.ENV_VARS_TO_PROPAGATE
    assert constants.DEFAULT_HEALTH_CHECK_INTERVAL_S > 0.5  # what the setting shortens
    environ = {}
    ray_train.set_ray_train_environment(environ)
    assert environ == {"RAY_CHDIR_TO_TRIAL_DIR": "0", name: "0.5"}
    chosen = {name: "3", "RAY_CHDIR_TO_TRIAL_DIR": "1"}
    ray_train.set_ray_train_environment(chosen)
    # the user's interval kept; the workers stay in the job's directory whatever the environment said
    assert chosen == {name: "3", "RAY_CHDIR_TO_TRIAL_DIR": "0"}
