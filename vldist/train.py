"""Train a recipe: `python -m vldist.train [JOB] [section.key=value ...]`.

JOB is a job file name under jobs/ (default: vsrn) or a path to a YAML job file.

Exit codes (the whole catalogue of bad input: docs/bad-input.md):
  0   trained and evaluated
  1   the run failed: a non-finite loss, a checkpoint that cannot be written (a full disk), an
      evaluation split with no readable sample, a Ray run that failed for good, the caption
      metrics' Java that died
  2   refused before training: a bad job config, missing shards, a checkpoint that cannot be
      resumed (none usable, or another model), output.dir in use by another run, no Java for
      the caption metrics
  75  stopped by a signal (train.stop_signals) after checkpointing the step it reached; the same
      command with train.resume=auto carries on (docs/preemption.md)
  130 interrupted by Ctrl-C: nothing after the last checkpoint was kept
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from vldist.checkpoint import CheckpointError, CheckpointWriteError, step_checkpoints
from vldist.compat import IncompatibleCheckpoint
from vldist.config import (
    ConfigError, DataConfig, JobConfig, deep_merge, describe_keys, find_job_file, job_config_class,
    list_job_files, parse_overrides, read_yaml, validate,
)
from vldist.data.shardset import ShardSet, ShardsNotFoundError, ShardsUnfitError
from vldist import ray_launcher
from vldist.distributed.collectives import gather_objects
from vldist.distributed.engine import make_engine
from vldist.eval_split import EmptySplitError
from vldist.metrics.captions import CaptionMetricsError, JavaNotFoundError
from vldist.preemption import EXIT_STOPPED, TrainingStopped, stop_requests
from vldist.recipes import RECIPES, get_recipe
from vldist.recipes.base import StreamSource
from vldist.run_lock import OutputDirInUse, RunLock
from vldist.telemetry.prometheus import start_rank_metrics

log = logging.getLogger("vldist.train")
DEFAULT_JOB = "vsrn"
SYNTH_DIR = DataConfig.model_fields["shards"].default
PAIRS_DIR = "shards/synth_pairs"

REFUSED = (ConfigError, ShardsNotFoundError, ShardsUnfitError, CheckpointError, IncompatibleCheckpoint,
           OutputDirInUse, JavaNotFoundError)  # exit 2
FAILED = (ray_launcher.RunFailed, CheckpointWriteError, EmptySplitError,
          CaptionMetricsError)  # exit 1, with NonFiniteLossError


def config_class(recipe: str) -> type[JobConfig]:
    try:
        return job_config_class(get_recipe(recipe).ModelConfig)
    except ValueError as err:
        raise ConfigError(f"recipe: {err}") from None


def load_config(job: str, overrides: list[str]) -> JobConfig:
    path = find_job_file(job)
    raw = deep_merge(read_yaml(path), parse_overrides(overrides))
    if "recipe" not in raw:
        raise ConfigError(f"{path} does not name a recipe (add `recipe: <name>`; recipes: {', '.join(RECIPES)})")
    return validate(raw, config_class(raw["recipe"]))


# The embedded sets vldist generates itself, by their default directory: built on first use.
EMBEDDED_SETS = {
    SYNTH_DIR: ("vldist.shards.synthetic.synth", "build_synth", "the embedded synthetic dataset"),
    PAIRS_DIR: ("vldist.shards.synthetic.pairs", "build_synth_pairs", "the embedded image-pair dataset (L2C)"),
}


def stream_sets(config: JobConfig) -> list[str]:
    """Shard sets other than data.shards that the job's training streams read (L2C: single images)."""
    recipe = get_recipe(config.recipe)(config, vocab=None)
    sources = recipe.train_streams().values()
    return list(dict.fromkeys(s.shards for s in sources if isinstance(s, StreamSource) and s.shards
                              and s.shards != config.data.shards))


def open_shards(config: JobConfig) -> ShardSet:
    """The job's shard set. Embedded sets the job reads (data.shards, or the set of another training
    stream, as L2C's single-image captions) are built on first use."""
    for directory in [config.data.shards, *stream_sets(config)]:
        if directory in EMBEDDED_SETS and config.data.build_if_missing and not Path(directory).exists():
            module, builder, what = EMBEDDED_SETS[directory]
            log.info("shards '%s' not found: building %s (once, about a minute)", directory, what)
            getattr(importlib.import_module(module), builder)(directory)
    return ShardSet.open(config.data.shards)


def split_args(argv: list[str]) -> tuple[str, list[str]]:
    if argv and "=" not in argv[0]:
        return argv[0], argv[1:]
    return DEFAULT_JOB, argv


def usage(job: str) -> str:
    lines = [
        "usage: python -m vldist.train [JOB] [section.key=value ...]",
        "",
        "Trains a recipe on WebDataset shards, evaluates it and writes checkpoints and metrics.json.",
        "",
        "recipes:",
        *(f"  {name:<18}{r.description}" for name, r in RECIPES.items()),
        "job files (jobs/*.yaml): " + ", ".join(list_job_files()),
        "",
        f"config keys of job '{job}' with their values (override any as section.key=value):",
    ]
    try:
        lines += ["  " + line for line in describe_keys(load_config(job, []))]
    except ConfigError as err:
        lines.append(f"  (cannot load job '{job}': {err})")
    return "\n".join(lines)


def run(config: JobConfig, on_checkpoint=None, stop_file: Path | None = None, last: bool = True) -> dict | None:
    """Train in this process, one rank of however many the launcher started; rank 0 returns the
    results. `on_checkpoint(path, metrics)` is called on every rank after each step checkpoint.
    A stop signal (or `stop_file` appearing) ends it with TrainingStopped after a checkpoint.
    `last`: no other run follows in this process (else the process group is kept for it)."""
    from vldist.trainer import Trainer

    with stop_requests(config.train.stop_signals, stop_file) as stop:
        engine = make_engine(config)
        metrics = None
        try:
            with output_dir_lock(engine, config.output_dir):
                if not engine.is_main:
                    logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only of trouble
                shards = open_shards(config) if engine.is_main else None
                engine.barrier()  # rank 0 builds missing shards; the others wait, then open them
                shards = shards or ShardSet.open(config.data.shards)
                recipe_cls = get_recipe(config.recipe)
                others = tuple(ShardSet.open(d) for d in stream_sets(config))  # their captions join the vocabulary
                recipe = recipe_cls(config, shards.vocab(config.output_dir, config.data.vocab_min_count, others),
                                    shards.feature_dim())
                recipe.preflight()
                log.info("%s on %s (%s x %d), output in %s", config.recipe, shards.directory, engine.device,
                         engine.world_size, config.output_dir)
                metrics = start_rank_metrics(config, engine.rank, engine.local_rank)
                results = Trainer(config, recipe, engine, shards, on_checkpoint, metrics, stop).fit()
                return results if engine.is_main else None
        finally:
            if metrics is not None:
                metrics.close(config.metrics.linger_seconds)
            engine.close(keep_process_group=not last)


@contextmanager
def output_dir_lock(engine, directory: Path):
    """Rank 0 holds the output directory for the run; if another run holds it, every rank refuses."""
    lock, error = None, None
    if engine.is_main:
        try:
            lock = RunLock(directory).acquire()
        except OutputDirInUse as err:
            error = str(err)
    refused = [e for e in gather_objects(error) if e]
    if refused:
        raise OutputDirInUse(refused[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def print_results(config: JobConfig, results: dict) -> None:
    """The results table; a job of several stages shows each stage's model side by side (and the
    untrained model of the first)."""
    recipe = get_recipe(config.recipe)(config, vocab=None)
    test = results["test"]
    stages = results.get("stages", {"trained": results})
    untrained = {}  # every stage's untrained model (CL: the MLE stage's; two-branch: one per task)
    for stage in stages.values():
        untrained.update(stage.get("untrained") or {})
    rows = {"untrained": untrained} if untrained else {}
    rows.update({name: stage["test"] for name, stage in stages.items()})
    print(f"\n{config.recipe} on {config.data.shards}, {config.eval.split} split: {test['n_images']} {test.get('unit', 'images')}, "
          f"{test['n_captions']} captions, {results['steps']} steps in {results['wall_seconds']:.0f} s")
    print(recipe.report(rows, config.eval.split))
    out = config.output_dir
    best = out / "checkpoints" / "best"  # none without validation: the last step's weights were tested
    checkpoint = best if best.is_dir() else next(iter(reversed(step_checkpoints(out / "checkpoints"))), best)
    print(f"checkpoint: {checkpoint}   metrics: {out / 'metrics.json'}")


def _speaks() -> bool:
    """Rank 0 (or a single process) reports errors; the other ranks reached the same verdict."""
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    from vldist.trainer import NonFiniteLossError

    argv = list(sys.argv[1:] if argv is None else argv)
    job, overrides = split_args([a for a in argv if a not in ("-h", "--help")])
    if len(argv) != len([a for a in argv if a not in ("-h", "--help")]):
        print(usage(job))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    code, message = 0, None
    try:
        config, results = run_stages(load_config(job, overrides))
    except REFUSED as err:
        code, message = 2, f"error: {err}"
    except (*FAILED, NonFiniteLossError) as err:
        code, message = 1, f"error: {err}"
    except (TrainingStopped, ray_launcher.RunStopped) as err:
        code, message = EXIT_STOPPED, str(err)
    except KeyboardInterrupt:
        code, message = 130, ("interrupted: nothing after the last checkpoint was kept (train.resume=latest "
                              "carries on from it; train.stop_signals=[SIGTERM,SIGUSR1,SIGINT] checkpoints on Ctrl-C)")
    if message is not None:
        if _speaks():
            print(message, file=sys.stderr)
        return code
    if results is not None:  # rank 0
        print_results(config, results)
    return 0


def run_stages(config: JobConfig) -> tuple[JobConfig, dict | None]:
    """Every run of the job in order (Recipe.stages: most jobs are one run), each through Ray when
    asked. With several stages, stage s writes to <output.dir>/<s> (under Ray: <run dir>/<s>), and
    a stage other than the last that finished before (its metrics.json is there) is not run again.
    Returns the last stage's config and, on rank 0, its results with `stages`: every stage's."""
    use_ray = ray_launcher.wanted(config)
    if use_ray:  # the stages' directories go under the Ray run directory
        config = config.model_copy(update={"output": config.output.model_copy(
            update={"dir": str(ray_launcher.run_dir(config))})})
    stages = get_recipe(config.recipe).stages(config)
    done: dict[str, dict] = {}
    results = None
    for index, (name, stage) in enumerate(stages):
        if len(stages) > 1:
            run_name = f"{config.ray.name.format(recipe=config.recipe)}/{name}"
            stage = stage.model_copy(update={
                "output": stage.output.model_copy(update={"dir": str(config.output_dir / name)}),
                "ray": stage.ray.model_copy(update={"name": run_name}),
            })
            finished = stage.output_dir / "metrics.json"
            if index < len(stages) - 1 and finished.is_file():
                log.info("stage '%s' finished before: using %s", name, finished)
                done[name] = json.loads(finished.read_text())
                continue
            log.info("stage %d/%d of %s: '%s' (recipe %s), output in %s", index + 1, len(stages), config.recipe,
                     name, stage.recipe, stage.output_dir)
        results = ray_launcher.launch(stage) if use_ray else run(stage, last=index == len(stages) - 1)
        if use_ray:
            stage = ray_launcher.worker_config(stage)  # where the results were written
        if results is not None:
            done[name] = results
    if results is not None and len(stages) > 1:
        results = {**results, "stages": done}
    return stage, results


if __name__ == "__main__":
    sys.exit(main())
