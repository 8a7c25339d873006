"""What a Ray job does with the run directory it names (`ray.storage_path/ray.name`).

Under Ray the run directory is the job's identity: submitting the same job again carries on where
it stopped (train.resume defaults to auto). The driver looks before any worker starts, at the
newest complete step checkpoint in the directory and in output.checkpoint_dir's store:

- none: a new run;
- a run of other settings (what it trains: the model, the data, the schedule, the seed; not how
  it runs: workers, logging, timeouts, where things go): refused, naming the keys that differ;
- a finished run (its newest checkpoint is its last step's): refused, neither resumed nor
  overwritten;
- else the stopped run resumes, and the driver says from which step.

A refusal says how to start afresh (another ray.name) and how to carry on anyway: an explicit
train.resume=latest (or a checkpoint's path) resumes whatever the settings, as plain runs do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from vldist.checkpoint import upgrades
from vldist.checkpoint.format import read_config, read_meta, step_checkpoints
from vldist.checkpoint.object_store import CheckpointStore
from vldist.config import JobConfig
from vldist.data.job_shards import built_where_read
from vldist.errors import RunDirectoryTaken
from vldist.store.location import is_url, redact, unreachable

# What may change between submissions of one run: how and where it runs, not what it trains. A
# whole section, or one section.key. Every other key must match the run's own config.yaml.
HOW_IT_RUNS = {
    "launcher",
    "ray",
    "metrics",
    "output",
    "eval",
    "data.storage_options",
    "data.retries",
    "data.cache_dir",
    "data.cache_max_gb",
    "data.max_skipped_fraction",
    "data.build_if_missing",
    "data.workers",
    "data.eval_batch_size",
    "data.test_split",
    "train.resume",
    "train.log_every",
    "train.stop_signals",
    "train.hang_timeout_s",
    "train.straggler_ratio",
    "train.threads",
    "train.device",
    "train.keep_last",
    "train.save_every_steps",
    "train.async_checkpoints",
    "train.checkpoint_format",
    "train.replica_check_every",
    # compiled and eager runs take the same steps and write the same checkpoints (docs/performance.md)
    "train.compile",
    "train.compile_backend",
    "train.compile_mode",
    "train.compile_dynamic",
    "train.profile_steps",
    "engine.tf32",
    "engine.timeout_s",
}


@dataclass
class Newest:
    """The newest complete step checkpoint of a run: where it is, its step (meta.json's), its
    meta.json and config.yaml."""

    where: str
    step: int
    meta: dict
    config: dict


def settings_differences(recorded: dict, job: dict) -> list[str]:
    """'key: the run's X, this job's Y' for every setting of what a run trains that differs between
    a run's recorded config and a job's (both as dicts); keys the record lacks (a newer vldist's)
    are not compared."""
    differ, theirs_all = [], _settings(recorded)
    for key, value in _settings(job).items():
        theirs = theirs_all.get(key, value)
        if key == "data.shards":
            theirs, value = _shard_set(theirs, recorded), _shard_set(value, job)
        if theirs != value:
            differ.append(f"{key}: the run's {theirs!r}, this job's {value!r}")
    return differ


def _settings(config: dict) -> dict:
    flat = {}
    for section, values in config.items():
        if section in HOW_IT_RUNS:
            continue
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            name = section if key is None else f"{section}.{key}"
            if name not in HOW_IT_RUNS:
                flat[name] = value
    return flat


def _shard_set(shards: str, config: dict) -> str:
    """data.shards as it names the data: an embedded set by its name (each node builds it in its
    own working directory), a URL as it is, a path made absolute."""
    if built_where_read(shards, config.get("data", {}).get("build_if_missing", True)) or is_url(shards):
        return shards
    return str(Path(shards).expanduser().resolve())


def newest_checkpoint(config: JobConfig) -> Newest | None:
    """The run's newest complete step checkpoint, on the driver's disk or in the store."""
    found = []
    local = step_checkpoints(config.output_dir / "checkpoints")
    if local:
        meta = read_meta(local[-1])
        found.append(Newest(str(local[-1]), meta["step"], meta, read_config(local[-1])))
    if config.output.checkpoint_dir:
        store = CheckpointStore(config.output.checkpoint_dir, config.output.storage_options)
        try:
            names = store.step_checkpoints()
            if names:
                meta = json.loads(store.read_file(names[-1], "meta.json"))
                raw = yaml.safe_load(store.read_file(names[-1], "config.yaml")) or {}
                found.append(Newest(store.where(names[-1]), meta["step"], meta, upgrades.upgrade_config(raw, meta)))
        except (OSError, ValueError, yaml.YAMLError) as err:
            raise unreachable(config.output.checkpoint_dir, err) from None
    return max(found, key=lambda n: n.step, default=None)


def _finished(newest: Newest, run_dir: Path) -> bool:
    """Its last step's checkpoint (meta.json says `final`; older checkpoints do not), or the step
    the finished run's metrics.json reports."""
    if newest.meta.get("final"):
        return True
    try:
        return json.loads((run_dir / "metrics.json").read_text()).get("steps") == newest.step
    except (OSError, ValueError):
        return False


def check_run_directory(config: JobConfig, resume_given: str | None) -> str:
    """The line the driver says about the run directory of `config` (a worker's config: output.dir
    is the run directory); raises RunDirectoryTaken where the job must not go on in it.
    `resume_given`: train.resume as the job gave it (None: the default, auto; latest or a path
    carries on whatever the run)."""
    out = config.output_dir
    newest = newest_checkpoint(config)
    if newest is None:
        return f"Ray run directory {out}: a new run" + (f" (train.resume={resume_given})" if resume_given else "")
    if resume_given not in (None, "auto"):
        return (
            f"Ray run directory {out}: train.resume={resume_given} as given; its newest checkpoint is step "
            f"{newest.step} ({newest.where})"
        )
    afresh = start_afresh(config, use_ray=True)
    refuse_other_settings(
        newest.config,
        config,
        f"the Ray run directory {out} holds a run",
        f"{afresh}; or pass train.resume=latest to carry on from its step-{newest.step} checkpoint "
        "with this job's settings",
    )
    if _finished(newest, out):
        evaluate = redact(config.output.checkpoint_dir) if config.output.checkpoint_dir else str(out)
        raise RunDirectoryTaken(
            f"the run in the Ray run directory {out} finished: its newest checkpoint is its last step's, "
            f"{newest.step} ({newest.where}), so submitting it again neither trains it further nor starts it over. "
            f"{afresh}; evaluate it with `python -m vldist.evaluate {evaluate}`; to train it further, raise "
            "train.max_steps (or train.epochs) and pass train.resume=latest."
        )
    return f"Ray run directory {out}: resuming the stopped run from step {newest.step} ({newest.where})"


def start_afresh(config: JobConfig, use_ray: bool) -> str:
    """How to start a job afresh instead of going on in its (stage's) directory."""
    if use_ray:  # a job of several stages names each stage's run <name>/<stage>
        name = config.ray.name.format(recipe=config.recipe).split("/")[0]
        return f"Start afresh with another ray.name (e.g. ray.name={name}-2) or after removing {config.output_dir}"
    return f"Start afresh in another output.dir or after removing {config.output_dir}"


def refuse_other_settings(recorded: dict, config: JobConfig, what: str, remedy: str) -> None:
    """Raise RunDirectoryTaken, saying `what` (a run, a finished stage) has other settings than
    `config` and which, then `remedy`, unless they train the same."""
    differ = settings_differences(recorded, config.model_dump(mode="json"))
    if differ:
        raise RunDirectoryTaken(
            f"{what}, with other settings than this job ({len(differ)} differ: {'; '.join(differ)}): "
            f"only the job that started it carries it on. {remedy}."
        )
