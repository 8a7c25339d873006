"""Train a recipe: `python -m vldist.train [JOB] [section.key=value ...]`.

JOB is a job file name under jobs/ (default: vsrn) or a path to a YAML job file.

Parse the command line, run the job's stages (each on its launcher), print the results table,
exit with the code `vldist/exit_codes.py` gives (0 done, 1 failed, 2 refused, 75 stopped, 130
Ctrl-C; every bad input and its message: docs/bad-input.md). Nothing imports this module.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys

# Only what --help needs at the top: the platform (training/, engines, Ray, checkpoints) is
# imported inside the functions that train, so that `--help` answers without loading it.
from vldist.config import JobConfig, describe_keys, list_job_files
from vldist.errors import ConfigError
from vldist.recipes import get_recipe, recipe_names
from vldist.recipes.jobs import load_config

log = logging.getLogger("vldist.train")
DEFAULT_JOB = "vsrn"


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
        *(f"  {name:<18}{get_recipe(name).description}" for name in recipe_names()),
        "job files (vldist's jobs/, the plugins' and ./jobs): " + ", ".join(list_job_files()),
        "",
        f"config keys of job '{job}' with their values (override any as section.key=value):",
    ]
    try:
        lines += ["  " + line for line in describe_keys(load_config(job, []))]
    except ConfigError as err:
        lines.append(f"  (cannot load job '{job}': {err})")
    return "\n".join(lines)


def print_results(config: JobConfig, results: dict) -> None:
    """The results table; a job of several stages shows each stage's model side by side (and the
    untrained model of the first)."""
    from vldist.checkpoint.format import step_checkpoints
    from vldist.store.location import redact

    recipe = get_recipe(config.recipe)  # its report is a class method: no model or vocabulary needed
    test = results["test"]
    stages = results.get("stages", {"trained": results})
    untrained = {}  # every stage's untrained model (CL: the MLE stage's; two-branch: one per task)
    for stage in stages.values():
        untrained.update(stage.get("untrained") or {})
    rows = {"untrained": untrained} if untrained else {}
    rows.update({name: stage["test"] for name, stage in stages.items()})
    print(
        f"\n{config.recipe} on {config.data.shards}, {config.eval.split} split: {test['n_images']} {test.get('unit', 'images')}, "
        f"{test['n_captions']} captions, {results['steps']} steps in {results['wall_seconds']:.0f} s"
    )
    print(recipe.report(rows, config.eval.split))
    out = config.output_dir
    best = out / "checkpoints" / "best"  # none without validation: the last step's weights were tested
    checkpoint = best if best.is_dir() else next(iter(reversed(step_checkpoints(out / "checkpoints"))), best)
    print(f"checkpoint: {checkpoint}   metrics: {out / 'metrics.json'}")
    if config.output.checkpoint_dir:  # where every node finds them (the paths above are rank 0's disk's)
        print(f"checkpoints in the store: {redact(config.output.checkpoint_dir)}")


def _speaks() -> bool:
    """Rank 0 (or a single process) reports errors; the other ranks reached the same verdict."""
    return os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def _startup_imports_frozen(program: bool):
    """The program's startup: importing torch and the recipe makes some 300,000 objects that live
    as long as the process, and every full collection went through them all (seven in a 10-step
    VSRN run, 0.8 s of CPU, finding next to nothing). No collection until they are loaded; then
    gc.freeze() leaves them out of every later one (four in that run, 0.26 s), which also keeps
    forked loader workers from writing to their shared pages. (What the imports left unreachable,
    about 0.8 MB, stays.) Not for a caller in its own process (`main(argv)`), whose objects are not
    this program's to freeze."""
    if not program or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    """argv None: this process's own command line (`python -m vldist.train`, `vldist-train`)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    job, overrides = split_args([a for a in argv if a not in ("-h", "--help")])
    if len(argv) != len([a for a in argv if a not in ("-h", "--help")]):
        print(usage(job))
        return 0  # exit_codes.DONE: --help imports nothing it does not need (tests/unit/test_help_imports.py)
    from vldist.errors import PeerLost
    from vldist.exit_codes import DONE, REPORTED_ERRORS, exit_status
    from vldist.launch.environment import rejoin_warning

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if _speaks() and (warning := rejoin_warning()):  # torchrun's agents: a lost node could not rejoin
        log.warning("%s", warning)
    try:
        with _startup_imports_frozen(program):
            config = load_config(job, overrides)
        config, results = run_stages(config)
    except (*REPORTED_ERRORS, KeyboardInterrupt) as err:  # Ctrl-C too: training says what it kept
        code, message = exit_status(err)
        if _speaks() or isinstance(err, PeerLost):  # rank 0 may be the one lost
            print(message, file=sys.stderr)
        return code
    if results is not None:  # rank 0
        print_results(config, results)
    return DONE


def run_stages(config: JobConfig) -> tuple[JobConfig, dict | None]:
    """Every run of the job in order (Recipe.stages: most jobs are one run), each through Ray when
    asked. With several stages, stage s writes to <output.dir>/<s> (under Ray: <run dir>/<s>; in the
    store, <output.checkpoint_dir>/<s>), and
    a stage other than the last that finished before (its metrics.json is there) is not run again.
    Returns the last stage's config and, on rank 0, its results with `stages`: every stage's."""
    from vldist.launch import ray_train
    from vldist.launch.resubmission import refuse_other_settings, start_afresh
    from vldist.training.on_each_rank import run

    use_ray = ray_train.wanted(config)
    if use_ray:  # the stages' directories go under the Ray run directory
        config = config.model_copy(
            update={"output": config.output.model_copy(update={"dir": str(ray_train.run_dir(config))})}
        )
    stages = get_recipe(config.recipe).stages(config)
    done: dict[str, dict] = {}
    results = None
    for index, (name, stage) in enumerate(stages):
        if len(stages) > 1:
            run_name = f"{config.ray.name.format(recipe=config.recipe)}/{name}"
            store = stage.output.checkpoint_dir
            stage = stage.model_copy(
                update={
                    # each stage its own checkpoints, also in the store: a stage never resumes from another's
                    "output": stage.output.model_copy(
                        update={
                            "dir": str(config.output_dir / name),
                            "checkpoint_dir": f"{store.rstrip('/')}/{name}" if store else None,
                        }
                    ),
                    "ray": stage.ray.model_copy(update={"name": run_name}),
                }
            )
            finished = stage.output_dir / "metrics.json"
            if index < len(stages) - 1 and finished.is_file():
                done[name] = json.loads(finished.read_text())
                refuse_other_settings(
                    done[name].get("config", {}),
                    stage,
                    f"stage '{name}' finished before in {stage.output_dir}",
                    start_afresh(stage, use_ray),
                )
                log.info("stage '%s' finished before: using %s", name, finished)
                continue
            log.info(
                "stage %d/%d of %s: '%s' (recipe %s), output in %s",
                index + 1,
                len(stages),
                config.recipe,
                name,
                stage.recipe,
                stage.output_dir,
            )
        results = ray_train.launch(stage, run) if use_ray else run(stage, last=index == len(stages) - 1)
        if use_ray:
            stage = ray_train.worker_config(stage)  # where the results were written
        if results is not None:
            done[name] = results
    if results is not None and len(stages) > 1:
        results = {**results, "stages": done}
    return stage, results


if __name__ == "__main__":
    sys.exit(main())
