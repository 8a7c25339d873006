"""Ray: `python -m vldist.train <recipe>` inside `ray job submit` (or with launcher=ray) fans out
over the cluster as a Ray Train `TorchTrainer`.

The driver (this process) checks the config and the run directory (resubmission.py: a new run,
a stopped one resumed, or a refusal) and starts `ray.num_workers` workers. Ray forms their process
group (gloo on CPU, NCCL on GPU) and each worker runs the function `launch` is given
(`vldist.training.on_each_rank.run`, what torchrun's ranks run), with the same engine, in the job's working
directory on its node (where Ray unpacks `--working-dir`). An embedded set (shards/synth) is read
from its node's data home (vldist/data/embedded_home.py: $VLDIST_DATA_HOME, else ~/.cache/vldist, as
the node's `ray start` or the job's runtime_env sets them), and each node's first worker builds it
there if missing, as torchrun's ranks do. The run directory
(checkpoints, metrics.json) is `ray.storage_path/ray.name`: on a disk every node shares, or, with
`output.checkpoint_dir` in object storage, a local directory on each node (a worker downloads the
checkpoints its node lacks). Each checkpoint vldist commits is reported to Ray where it lies (no
copy); when a worker dies, Ray restarts the group (up to `ray.max_failures` times) and the
workers resume from the newest checkpoint in the run directory or the store. With `ray.num_workers=MIN:MAX` the group is elastic (Ray Train
V2): it starts with as many workers as the cluster gives, at least MIN, and a restart after a lost
node carries on with the workers left; the checkpoint resumes on the new number of ranks
(checkpoint/manager.py). The driver's exit status is the run's.

Stopping: `ray job stop` sends SIGTERM to the driver alone (workers are actors). The driver
relays it through its run board (run_board.py), which the workers watch; they finish their step,
checkpoint and return, and the driver exits with exit_codes.STOPPED. Ray kills the driver
RAY_JOB_STOP_WAIT_TIME_S after the signal (3 s unless the job's runtime_env sets it), so give it
the time a step and a checkpoint take. Submitting the same job again resumes (train.resume
defaults to auto here); a finished run or one of other settings is refused (resubmission.py).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, MutableMapping
from contextlib import contextmanager
from pathlib import Path

from vldist.config import JobConfig
from vldist.data.job_shards import built_where_read
from vldist.errors import ConfigError, ReplicasDiverged, RunFailed, RunStopped, TrainingStopped
from vldist.launch.resubmission import check_run_directory
from vldist.launch.run_board import open_board, stop_watch
from vldist.recipes.jobs import validate_job
from vldist.store.location import is_url
from vldist.training.run_lock import check_free
from vldist.training.stopping import signal_numbers

# A rank's run: (config, on_checkpoint, stop_watch) -> results on rank 0 (vldist.training.on_each_rank.run)
TrainFunction = Callable[..., "dict | None"]

log = logging.getLogger("vldist.ray")


def wanted(config: JobConfig) -> bool:
    """launcher=ray, or launcher=auto in the driver of a Ray job (not in a torchrun/srun rank)."""
    if config.launcher != "auto":
        return config.launcher == "ray"
    return bool(os.environ.get("RAY_ADDRESS")) and "RANK" not in os.environ  # ray job submit sets RAY_ADDRESS


def run_dir(config: JobConfig) -> Path:
    return Path(config.ray.storage_path).expanduser().resolve() / config.ray.name.format(recipe=config.recipe)


def absolute(where: str) -> str:
    """A local path made absolute; a URL (s3://...) as it is: every worker reads the same store."""
    return where if is_url(where) else str(Path(where).expanduser().resolve())


def worker_shards(data) -> str:
    """data.shards as the workers read it: the driver's path made absolute (the same path on every
    node), except an embedded set's name, which each worker resolves on its own node (embedded_home.py:
    the driver's directory may not exist on other nodes; the set is built where it is missing)."""
    return data.shards if built_where_read(data.shards, data.build_if_missing) else absolute(data.shards)


def worker_config(config: JobConfig) -> JobConfig:
    """The config the workers run: absolute paths (workers start in other directories, maybe on
    other machines) but an embedded set's name, and the run directory as output."""
    return config.model_copy(
        update={
            "data": config.data.model_copy(update={"shards": worker_shards(config.data)}),
            "output": config.output.model_copy(update={"dir": str(run_dir(config))}),
            # a job submitted again carries on where it stopped (a new run needs a new ray.name)
            "train": config.train.model_copy(update={"resume": config.train.resume or "auto"}),
            "metrics": config.metrics.model_copy(
                update={"targets_dir": config.metrics.targets_dir or str(run_dir(config) / "prometheus")}
            ),
            "launcher": "local",
        }
    )


def check_batch_splits(config: JobConfig, fewest: int, most: int) -> None:
    """Every group size Ray may start must split the global batch: refuse the range now, not on a
    restart hours later."""
    slices = config.train.grad_accumulation
    bad = [n for n in range(fewest, most + 1) if config.data.batch_size % (n * slices)]
    if bad:
        raise ConfigError(
            f"ray.num_workers={config.ray.num_workers}: data.batch_size={config.data.batch_size} (x "
            f"train.grad_accumulation={slices}) cannot be split over {', '.join(map(str, bad))} workers, and Ray may start "
            "any number in the range. Choose a range whose every size divides the batch, or another data.batch_size"
        )


def _train_worker(train: TrainFunction, board, payload: dict) -> None:
    """What every Ray Train worker runs: `train`, the ordinary rank's run, reporting checkpoints
    to Ray, watching the driver's board (run_board.py) for a stop request; rank 0 posts the outcome
    there."""
    import ray
    import ray.train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config = validate_job(payload)
    restored = ray.train.get_checkpoint()
    if restored is not None:
        # A restart after a failure, or a new submission of the run. Ray hands back the last
        # checkpoint it registered, but registration lags the writes and vldist may have pruned
        # that one since; the run directory (and output.checkpoint_dir's store) holds every
        # committed checkpoint, and train.resume (auto under Ray, see worker_config) takes its
        # newest good one.
        log.info(
            "Ray's last registered checkpoint is %s (a restart, or the job submitted again); resuming from the "
            "newest in the run directory",
            restored.path,
        )
    rank0 = ray.train.get_context().get_world_rank() == 0

    def report(path: Path, metrics: dict) -> None:
        checkpoint = ray.train.Checkpoint(path=str(path)) if rank0 else None
        # The checkpoint already lies in the run directory (or the store): register, do not copy.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=lambda ckpt, _name: ckpt)

    try:
        results = train(config, on_checkpoint=report, stop_watch=stop_watch(board))
        outcome = {"results": results}
    except TrainingStopped as stopped:  # a normal end for Ray; the driver reports it
        outcome = {"stopped": {"step": stopped.step, "checkpoint": str(stopped.checkpoint), "reason": stopped.reason}}
    except ReplicasDiverged as diverged:
        # Every rank reached this verdict together. Not a failure for Ray to retry: a restart would
        # resume from the newest checkpoint, which may hold a copy of the run already diverging.
        outcome = {"diverged": str(diverged)}
    if rank0:
        ray.get(board.post_outcome.remote(outcome))


@contextmanager
def relay_stop_signals(names, board):
    """In the driver: a stop signal becomes a stop request on the board the workers watch. The
    handler only notes it; a thread posts it (a Ray call inside a signal handler could re-enter Ray
    code the main thread was in)."""
    noted: list[str] = []
    wake, done = threading.Event(), threading.Event()

    def relay(signum, frame):
        noted.append(signal.Signals(signum).name)
        wake.set()
        os.write(
            2, f"vldist: {signal.Signals(signum).name} received: asking the workers to checkpoint and stop\n".encode()
        )

    def post():
        while not done.is_set():
            wake.wait()
            wake.clear()
            if noted:
                board.request_stop.remote(noted[0])  # once: a later signal changes nothing
                return

    poster = threading.Thread(target=post, name="vldist-stop-relay", daemon=True)
    previous = {sig: signal.signal(sig, relay) for sig in signal_numbers(names)}
    poster.start()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        done.set()
        wake.set()
        poster.join(timeout=10)


def set_ray_train_environment(environ: MutableMapping[str, str]) -> None:
    """What Ray Train reads from the driver's environment (and propagates to its controller)."""
    # Ray Train moves each worker into a directory of its own; vldist's workers stay where Ray
    # starts them, the job's working directory on their node, where relative names resolve alike
    # on every node (an embedded set, a job file). Read by TorchTrainer.fit in this process.
    environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    # The controller learns that the workers finished, failed or reported a checkpoint by polling
    # them, every 2 s by default: each job and each restart went on up to 2 s late
    # (docs/benchmarks.md, "Ray job latency"). A poll is a small remote call; one that a busy
    # worker does not answer in time is awaited in the next round (a worker is declared dead only
    # after Ray's 10 minutes). A value the user set stays.
    environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def launch(config: JobConfig, train: TrainFunction) -> dict:
    """Run the job on Ray, `train` on every worker; returns rank 0's results (raises if the run
    failed)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resume_given = config.train.resume
    config = worker_config(config)
    out = Path(config.output.dir)
    check_free(out)  # another run in this directory: refuse now, not in every worker
    log.info("%s", check_run_directory(config, resume_given))  # or refused: finished, or other settings
    if not ray.is_initialized():
        ray.init(address=config.ray.address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    gpus = config.ray.gpus_per_worker
    if gpus == "auto":
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    fewest, most = config.ray.worker_range
    check_batch_splits(config, fewest, most)
    log.info(
        "Ray: %s workers x (%g CPU, %g GPU), run directory %s",
        config.ray.num_workers,
        config.ray.cpus_per_worker,
        gpus,
        out,
    )
    board = open_board()
    set_ray_train_environment(os.environ)
    trainer = TorchTrainer(
        functools.partial(_train_worker, train, board),
        train_loop_config=config.model_dump(mode="json"),
        # Ray Train makes the process group; its timeout is the job's like under the other launchers
        torch_config=TorchConfig(timeout_s=max(1, round(config.engine.timeout_s))),
        scaling_config=ScalingConfig(
            # a range: Ray Train's elastic training (it starts with what it gets, at least the fewest)
            num_workers=most if fewest == most else (fewest, most),
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": config.ray.cpus_per_worker, **({"GPU": gpus} if gpus else {})},
        ),
        run_config=RunConfig(
            name=out.name,
            storage_path=str(out.parent),
            failure_config=FailureConfig(max_failures=config.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # vldist prunes its own
        ),
    )
    # after ray.init, which sets its own SIGTERM handler (sys.exit) in the driver
    with relay_stop_signals(config.train.stop_signals, board):
        try:
            trainer.fit()
        except Exception as err:  # a stop checkpointed before the failure still ends as a stop
            _raise_if_ended(board)
            if isinstance(err, ray.train.TrainingFailedError):
                raise RunFailed(f"the Ray run failed after {config.ray.max_failures} restarts at most: {err}") from None
            raise
    outcome = _raise_if_ended(board)
    if "results" not in outcome:
        raise RunFailed("the Ray run ended without rank 0's results (see the workers' output above)")
    return outcome["results"]


def _raise_if_ended(board) -> dict:
    """Rank 0's outcome on the board ({} if it cannot be read); RunStopped where it stopped,
    ReplicasDiverged (exit 4, as under the other launchers) where the replica check stopped it."""
    import ray

    try:
        outcome = ray.get(board.read_outcome.remote(), timeout=60) or {}
    except Exception:  # noqa: BLE001 - no board, no outcome: the caller says what failed
        return {}
    if "diverged" in outcome:
        raise ReplicasDiverged(outcome["diverged"])
    if "stopped" in outcome:
        stopped = outcome["stopped"]
        raise RunStopped(
            f"stopped by {stopped['reason']} after step {stopped['step']}; checkpoint {stopped['checkpoint']}. "
            "Submit the same job again to carry on from it."
        )
    return outcome
