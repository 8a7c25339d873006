"""What a Ray job does with the run directory it names (vldist/launch/resubmission.py): a new run,
the stopped run resumed, or a refusal (a finished run; a run of other settings). The checkpoints
are written with the checkpoint format's own functions; the driver reads only their meta.json and
config.yaml."""

import json
from pathlib import Path

import pytest

from vldist.checkpoint.format import save_checkpoint, step_name
from vldist.config import to_yaml
from vldist.data.vocab import Vocab
from vldist.errors import RunDirectoryTaken
from vldist.launch.ray_train import worker_config
from vldist.launch.resubmission import check_run_directory, settings_differences
from vldist.recipes.jobs import load_config


def job(tmp_path: Path, *overrides: str):
    """A job as the Ray driver hands it to its workers (its run directory under tmp_path)."""
    return worker_config(load_config("vsrn", [f"ray.storage_path={tmp_path}", "launcher=ray", *overrides]))


def checkpoint(directory: Path, config, step: int, final: bool = False) -> Path:
    return save_checkpoint(
        directory / step_name(step),
        model_state=None,
        train_state=None,
        config_yaml=to_yaml(config),
        vocab=Vocab(["a", "b"]),
        meta={"step": step, "epoch": 0, "final": final},
    )


def test_a_run_directory_without_a_checkpoint_is_a_new_run(tmp_path):
    config = job(tmp_path)
    assert check_run_directory(config, None) == f"Ray run directory {tmp_path / 'vsrn'}: a new run"


def test_the_same_job_resumes_the_stopped_run_whatever_says_how_it_runs(tmp_path):
    config = job(tmp_path)
    checkpoint(config.output_dir / "checkpoints", config, 8)
    newest = checkpoint(config.output_dir / "checkpoints", config, 16)
    # fewer workers, other logging, evaluation and timeouts: the same run
    again = job(
        tmp_path,
        "ray.num_workers=1",
        "train.log_every=5",
        "metrics.port=9500",
        "eval.beam_size=1",
        "train.hang_timeout_s=60",
        "engine.timeout_s=60",
        "data.workers=0",
        "train.save_every_steps=4",
        "train.compile=model",  # compiled or eager: the same steps, the same checkpoints
        "train.compile_backend=aot_eager",
        "train.profile_steps=2:3",
        "engine.tf32=false",
    )
    assert (
        check_run_directory(again, None)
        == f"Ray run directory {config.output_dir}: resuming the stopped run from step 16 ({newest})"
    )


def test_a_job_of_other_settings_is_refused_naming_each_key_and_what_to_do(tmp_path):
    config = job(tmp_path)
    checkpoint(config.output_dir / "checkpoints", config, 16)
    with pytest.raises(RunDirectoryTaken) as refused:
        check_run_directory(job(tmp_path, "train.lr=0.0005", "model.embed_size=64", "seed=3"), None)
    message = str(refused.value)
    assert message.startswith(
        f"the Ray run directory {config.output_dir} holds a run, with other settings than this job "
        "(3 differ: seed: the run's 0, this job's 3; train.lr: the run's 0.001, this job's 0.0005; "
        "model.embed_size: the run's 256, this job's 64)"
    ), message
    assert "Start afresh with another ray.name (e.g. ray.name=vsrn-2)" in message
    assert "pass train.resume=latest to carry on from its step-16 checkpoint with this job's settings" in message


def test_a_finished_run_is_neither_resumed_nor_started_over(tmp_path):
    config = job(tmp_path)
    last = checkpoint(config.output_dir / "checkpoints", config, 40, final=True)
    with pytest.raises(RunDirectoryTaken) as refused:
        check_run_directory(config, None)
    message = str(refused.value)
    assert message.startswith(
        f"the run in the Ray run directory {config.output_dir} finished: its newest checkpoint "
        f"is its last step's, 40 ({last})"
    ), message
    assert "ray.name=vsrn-2" in message and f"python -m vldist.evaluate {config.output_dir}" in message
    assert "raise train.max_steps (or train.epochs) and pass train.resume=latest" in message
    with pytest.raises(RunDirectoryTaken, match="finished"):  # train.resume=auto given: the default's rules
        check_run_directory(config, "auto")


def test_a_run_finished_before_checkpoints_said_so_is_known_by_its_metrics(tmp_path):
    """Checkpoints of an older vldist have no `final`: the run's metrics.json says where it ended."""
    config = job(tmp_path)
    checkpoint(config.output_dir / "checkpoints", config, 40)
    (config.output_dir / "metrics.json").write_text(json.dumps({"steps": 32}))  # an earlier, shorter end
    assert "resuming the stopped run from step 40" in check_run_directory(config, None)
    (config.output_dir / "metrics.json").write_text(json.dumps({"steps": 40}))
    with pytest.raises(RunDirectoryTaken, match="finished: its newest checkpoint is its last step's, 40"):
        check_run_directory(config, None)


def test_an_explicit_train_resume_carries_on_whatever_the_settings(tmp_path):
    config = job(tmp_path)
    newest = checkpoint(config.output_dir / "checkpoints", config, 40, final=True)
    other = job(tmp_path, "train.lr=0.0005", "train.max_steps=80", "train.resume=latest")
    assert check_run_directory(other, "latest") == (
        f"Ray run directory {config.output_dir}: train.resume=latest as "
        f"given; its newest checkpoint is step 40 ({newest})"
    )


def test_the_checkpoints_in_the_store_count_too(tmp_path):
    """output.checkpoint_dir (here a file:// store, through fsspec as s3:// is): its newest
    checkpoint is newer than the driver's disk's, and it is the finished one."""
    store = tmp_path / "store"
    config = job(tmp_path / "runs", f"output.checkpoint_dir=file://{store}")
    checkpoint(config.output_dir / "checkpoints", config, 8)
    checkpoint(store, config, 40, final=True)
    with pytest.raises(RunDirectoryTaken, match=f"its last step's, 40 \\(file://{store}/step-00000040\\)"):
        check_run_directory(config, None)


def test_shard_sets_compare_by_what_they_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = load_config("vsrn", []).model_dump(mode="json")

    def shards(value: str, **data) -> dict:
        return {**base, "data": {**base["data"], "shards": value, **data}}

    assert settings_differences(shards("shards/synth"), shards("shards/synth")) == []
    assert settings_differences(shards("data/coco"), shards(str(tmp_path / "data" / "coco"))) == []
    assert settings_differences(shards("s3://b/coco"), shards("s3://b/coco")) == []
    assert settings_differences(shards("shards/synth"), shards("s3://b/coco")) == [
        "data.shards: the run's 'shards/synth', this job's 's3://b/coco'"
    ]
    # a run's own embedded set, unpacked elsewhere by each submission, is the same set by name; a
    # set that is not built where read is a path like any other
    assert (
        settings_differences(
            shards("shards/synth", build_if_missing=False),
            shards(str(tmp_path / "shards/synth"), build_if_missing=False),
        )
        == []
    )


def test_a_key_the_run_did_not_record_is_not_compared():
    """A key a newer vldist added is missing from an older run's config.yaml."""
    config = load_config("vsrn", []).model_dump(mode="json")
    older = {**config, "train": {k: v for k, v in config["train"].items() if k != "negatives_group_size"}}
    assert settings_differences(older, {**config, "train": {**config["train"], "negatives_group_size": 8}}) == []
