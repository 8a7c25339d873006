"""Loading a job: a YAML job file and command-line overrides, checked against its recipe's keys."""

from __future__ import annotations

from vldist.config import JobConfig, deep_merge, find_job_file, job_config_class, parse_overrides, read_yaml, validate
from vldist.errors import ConfigError
from vldist.recipes import get_recipe, recipe_names


def config_class(recipe: str) -> type[JobConfig]:
    """The job config class of a recipe: the common sections and the recipe's own `model`."""
    try:
        return job_config_class(get_recipe(recipe).ModelConfig)
    except ValueError as err:
        raise ConfigError(f"recipe: {err}") from None


def load_config(job: str, overrides: list[str]) -> JobConfig:
    """Job `job` (a name under jobs/ or a path) with `section.key=value` overrides, validated."""
    path = find_job_file(job)
    raw = deep_merge(read_yaml(path), parse_overrides(overrides))
    if "recipe" not in raw:
        raise ConfigError(f"{path} does not name a recipe (add `recipe: <name>`; recipes: {', '.join(recipe_names())})")
    return validate(raw, config_class(raw["recipe"]))


def validate_job(raw: dict) -> JobConfig:
    """A job config from a dict (a checkpoint's config.yaml, a Ray worker's payload)."""
    return validate(raw, config_class(raw["recipe"]))
