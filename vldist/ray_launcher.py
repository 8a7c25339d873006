"""Ray: `python -m vldist.train <recipe>` inside `ray job submit` (or with launcher=ray) fans out
over the cluster as a Ray Train `TorchTrainer`.

The driver (this process) checks the config, builds missing default shards, and starts
`ray.num_workers` workers. Ray forms their process group (gloo on CPU, NCCL on GPU) and each worker
runs the same `vldist.train.run` that torchrun starts, with the same engine. The run directory
(checkpoints, metrics.json) is `ray.storage_path/ray.name`, which every node must see. Each
checkpoint vldist commits is reported to Ray where it lies (no copy); when a worker dies, Ray
restarts the group (up to `ray.max_failures` times) and the workers resume from the newest
checkpoint in the run directory. The driver's exit status is the run's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vldist.config import JobConfig

log = logging.getLogger("vldist.ray")


class RunFailed(RuntimeError):
    """The Ray run failed for good (after its restarts); the message holds the workers' error."""


def wanted(config: JobConfig) -> bool:
    """launcher=ray, or launcher=auto in the driver of a Ray job (not in a torchrun/srun rank)."""
    if config.launcher != "auto":
        return config.launcher == "ray"
    return bool(os.environ.get("RAY_ADDRESS")) and "RANK" not in os.environ  # ray job submit sets RAY_ADDRESS


def run_dir(config: JobConfig) -> Path:
    return Path(config.ray.storage_path).expanduser().resolve() / config.ray.name.format(recipe=config.recipe)


def worker_config(config: JobConfig) -> JobConfig:
    """The config the workers run: absolute paths (workers start in other directories, maybe on
    other machines) and the run directory as output."""
    return config.model_copy(update={
        "data": config.data.model_copy(update={"shards": str(Path(config.data.shards).expanduser().resolve())}),
        "output": config.output.model_copy(update={"dir": str(run_dir(config))}),
        "metrics": config.metrics.model_copy(
            update={"targets_dir": config.metrics.targets_dir or str(run_dir(config) / "prometheus")}
        ),
        "launcher": "local",
    })


def _train_worker(payload: dict) -> None:
    """What every Ray Train worker runs: the ordinary training run, reporting checkpoints to Ray."""
    import ray.train

    from vldist.config import validate
    from vldist.train import config_class, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config = validate(payload, config_class(payload["recipe"]))
    restored = ray.train.get_checkpoint()
    if restored is not None:
        # A restart after a failure. Ray hands back the last checkpoint it registered, but
        # registration lags the writes and vldist may have pruned that one since; the run
        # directory holds every committed checkpoint, so resume from its newest good one.
        log.info("Ray restart: Ray's last checkpoint is %s; resuming from the newest in the run directory", restored.path)
        config.train.resume = "latest"

    def report(path: Path, metrics: dict) -> None:
        checkpoint = ray.train.Checkpoint(path=str(path)) if ray.train.get_context().get_world_rank() == 0 else None
        # The checkpoint already lies in the run directory on shared storage: register, do not copy.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=lambda ckpt, _name: ckpt)

    run(config, on_checkpoint=report)


def launch(config: JobConfig) -> dict:
    """Run the job on Ray; returns rank 0's results (raises if the run failed)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from vldist.train import open_shards

    open_shards(config)  # build missing default shards once, here, before any worker starts
    config = worker_config(config)
    if not ray.is_initialized():
        ray.init(address=config.ray.address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    gpus = config.ray.gpus_per_worker
    if gpus == "auto":
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    out = Path(config.output.dir)
    log.info("Ray: %d workers x (%g CPU, %g GPU), run directory %s", config.ray.num_workers,
             config.ray.cpus_per_worker, gpus, out)
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config=config.model_dump(mode="json"),
        scaling_config=ScalingConfig(
            num_workers=config.ray.num_workers, use_gpu=gpus > 0,
            resources_per_worker={"CPU": config.ray.cpus_per_worker, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=out.name, storage_path=str(out.parent),
            failure_config=FailureConfig(max_failures=config.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # vldist prunes its own
        ),
    )
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as err:
        raise RunFailed(f"the Ray run failed after {config.ray.max_failures} restarts at most: {err}") from None
    return json.loads((out / "metrics.json").read_text())
