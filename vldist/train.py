"""Train a recipe: `python -m vldist.train [JOB] [section.key=value ...]`.

JOB is a job file name under jobs/ (default: vsrn) or a path to a YAML job file.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from vldist.config import (
    ConfigError, DataConfig, JobConfig, deep_merge, describe_keys, find_job_file, job_config_class,
    list_job_files, parse_overrides, read_yaml, validate,
)
from vldist.data.shardset import ShardSet, ShardsNotFoundError
from vldist import ray_launcher
from vldist.distributed.engine import make_engine
from vldist.recipes import RECIPES, get_recipe
from vldist.report import chance_recall, retrieval_table
from vldist.telemetry.prometheus import start_rank_metrics

log = logging.getLogger("vldist.train")
DEFAULT_JOB = "vsrn"
SYNTH_DIR = DataConfig.model_fields["shards"].default


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


def open_shards(config: JobConfig) -> ShardSet:
    """The job's shard set; the embedded synthetic set is built on first use."""
    directory = Path(config.data.shards)
    if not directory.exists() and config.data.build_if_missing and config.data.shards == SYNTH_DIR:
        from vldist.shards.synth import build_synth

        log.info("shards '%s' not found: building the embedded synthetic dataset (once, about a minute)", directory)
        build_synth(directory)
    return ShardSet.open(directory)


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


def run(config: JobConfig, on_checkpoint=None) -> dict | None:
    """Train in this process, one rank of however many the launcher started; rank 0 returns the
    results. `on_checkpoint(path, metrics)` is called on every rank after each step checkpoint."""
    from vldist.trainer import Trainer

    engine = make_engine(config)
    if not engine.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only of trouble
    shards = open_shards(config) if engine.is_main else None
    engine.barrier()  # rank 0 builds missing shards; the others wait, then open them
    shards = shards or ShardSet.open(config.data.shards)
    recipe_cls = get_recipe(config.recipe)
    recipe = recipe_cls(config, shards.vocab(config.output_dir), shards.feature_dim())
    log.info("%s on %s (%s x %d), output in %s", config.recipe, shards.directory, engine.device,
             engine.world_size, config.output_dir)
    metrics = start_rank_metrics(config, engine.rank, engine.local_rank)
    try:
        results = Trainer(config, recipe, engine, shards, on_checkpoint, metrics).fit()
        return results if engine.is_main else None
    finally:
        if metrics is not None:
            metrics.close(config.metrics.linger_seconds)
        engine.close()


def print_results(config: JobConfig, results: dict) -> None:
    recipe = get_recipe(config.recipe)(config, vocab=None)
    test = results["test"]
    rows = {"chance": chance_recall(test["n_images"], config.model.captions_per_image)}
    if "untrained" in results:
        rows["untrained"] = recipe.headline(results["untrained"])
    rows["trained"] = recipe.headline(test)
    print(f"\n{config.recipe} on {config.data.shards}, {config.eval.split} split: {test['n_images']} images, "
          f"{results['steps']} steps in {results['wall_seconds']:.0f} s")
    print(retrieval_table(rows))
    if "1k_5fold" in test:
        print("1K five-fold:\n" + retrieval_table({"trained": test["1k_5fold"]}))
    out = config.output_dir
    print(f"checkpoint: {out / 'checkpoints' / 'best'}   metrics: {out / 'metrics.json'}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job, overrides = split_args([a for a in argv if a not in ("-h", "--help")])
    if len(argv) != len([a for a in argv if a not in ("-h", "--help")]):
        print(usage(job))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        config = load_config(job, overrides)
        if ray_launcher.wanted(config):
            results = ray_launcher.launch(config)
            config = ray_launcher.worker_config(config)  # where the results were written
        else:
            results = run(config)
    except (ConfigError, ShardsNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ray_launcher.RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if results is not None:  # rank 0
        print_results(config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
