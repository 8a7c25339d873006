"""One rank's run of one job: the engine, the output directory's lock, the job's shard sets
(opened once), the vocabulary, the recipe and the weights it starts from, the metrics exporter,
then the trainer.

Every launcher runs this in each of its processes (launch/: this process, torchrun or srun ranks,
Ray Train workers); rank 0 returns the results.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from vldist.checkpoint.starting_weights import read_starting_weights
from vldist.config import JobConfig
from vldist.data.fit_to_job import warn_what_the_job_leaves_out
from vldist.data.job_shards import build_missing, open_job_shards
from vldist.distributed import make_engine
from vldist.distributed.collectives import gather_objects, set_negatives_group_size
from vldist.distributed.lost_rank import lost_rank_reported
from vldist.distributed.shared_output import check_output_shared
from vldist.errors import OutputDirInUse, OutputNotWritable, PeerLost, ShardsNotFoundError
from vldist.recipes import get_recipe
from vldist.store.location import filesystem, redact
from vldist.telemetry.prometheus import start_rank_metrics
from vldist.training.loop import Trainer
from vldist.training.run_lock import RunLock, check_writable
from vldist.training.stopping import stop_requests
from vldist.training.threads import set_torch_threads

log = logging.getLogger("vldist.train")


def _raise_if_any_rank_failed(failure: Exception | None, cls: type[Exception] | tuple[type[Exception], ...]) -> None:
    """Every rank raises when any rank failed, with the first failing rank's message (a set on
    some nodes' disks only names its host): rank 0 reports it, and no rank goes on alone into a
    collective that would wait for the others. `cls`: the error, or the errors a rank may fail
    with (the others raise the failing rank's type among them)."""
    classes = cls if isinstance(cls, tuple) else (cls,)
    mine = None if failure is None else (type(failure).__name__, str(failure))
    failures = [found for found in gather_objects(mine) if found]
    if failure is not None:
        raise failure
    if failures:
        name, message = failures[0]
        raise next((c for c in classes if c.__name__ == name), classes[0])(message)


def _launched_alone() -> bool:
    """No other rank will come (read before the engine: torchrun, accelerate and Ray set
    WORLD_SIZE; an srun step SLURM_STEP_NUM_TASKS)."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_STEP_NUM_TASKS") or 1) == 1


def unwritable_outputs(config: JobConfig) -> OutputNotWritable | None:
    """What this rank cannot write of the run's outputs, checked before the engine starts: the
    output directory (every rank writes there: checkpoint parts, downloads, sample logs), and on
    rank 0, which uploads, output.checkpoint_dir where it is a local directory (file://)."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    store = config.output.checkpoint_dir
    try:
        check_writable(config.output_dir, "output.dir")
        if store and rank == "0" and urlsplit(store).scheme in ("file", "local"):
            _, root = filesystem(store, config.output.storage_options)
            check_writable(Path(root), "output.checkpoint_dir", redact(store))
    except OutputNotWritable as err:
        if _launched_alone():
            return err
        return OutputNotWritable(f"rank {rank} on {socket.gethostname()}: {err}")  # which node, where disks differ
    return None


def _opened_on_every_rank(open_sets):
    failure = None
    try:
        opened = open_sets()
    except ShardsNotFoundError as err:
        opened, failure = None, err
    _raise_if_any_rank_failed(failure, ShardsNotFoundError)
    return opened


def run(
    config: JobConfig, on_checkpoint=None, stop_watch: Callable[[], str | None] | None = None, last: bool = True
) -> dict | None:
    """Train in this process, one rank of however many the launcher started; rank 0 returns the
    results. `on_checkpoint(path, metrics)` is called on every rank after each step checkpoint.
    A stop signal (or `stop_watch()` returning a reason) ends it with TrainingStopped after a checkpoint.
    `last`: no other run follows in this process (else the process group is kept for it)."""
    recipe_cls = get_recipe(config.recipe)
    set_torch_threads(config.train.threads)
    unwritable = unwritable_outputs(config)
    if unwritable is not None and _launched_alone():
        raise unwritable  # refused before any engine or process group starts
    with stop_requests(config.train.stop_signals, stop_watch) as stop:
        engine = make_engine(config)
        metrics = None
        try:
            with output_dir_lock(engine, config.output_dir, unwritable):
                if not engine.is_main:
                    logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only of trouble
                if engine.local_rank == 0:  # each node: the embedded sets are the same bytes wherever built
                    build_missing(config, recipe_cls)
                engine.barrier()  # a node's first rank builds missing shards (once per disk: a file lock); the others wait
                check_output_shared(engine, config)
                shards = _opened_on_every_rank(lambda: open_job_shards(config, recipe_cls))
                # the other streams' captions join the vocabulary
                vocab = shards.main.vocab(config.output_dir, config.data.vocab_min_count, tuple(shards.others.values()))
                recipe = recipe_cls(config, vocab, shards.main.feature_dim(), uniform_shapes=engine.uniform_shapes)
                recipe.preflight(shards.main)
                start = read_starting_weights(recipe.starts_from()) if recipe.starts_from() else None
                log.info(
                    "%s on %s (%s x %d), output in %s",
                    config.recipe,
                    shards.main.directory,
                    engine.device,
                    engine.world_size,
                    config.output_dir,
                )
                if engine.is_main:  # once a run: what of the set this job does not train on
                    warn_what_the_job_leaves_out(config, recipe, shards.main)
                if config.engine.mixed_precision != engine.precision:  # auto, or what a backend does on CPU
                    log.info(
                        "engine.mixed_precision=%s: %s on %s under engine.backend=%s",
                        config.engine.mixed_precision,
                        {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}[engine.precision],
                        engine.device,
                        config.engine.backend,
                    )
                metrics = start_rank_metrics(config, engine.rank, engine.local_rank)
                set_negatives_group_size(config.train.negatives_group_size)  # collective
                with lost_rank_reported(engine.rank, engine.world_size, config.output_dir / "checkpoints"):
                    results = Trainer(config, recipe, engine, shards, on_checkpoint, metrics, stop, start).fit()
                return results if engine.is_main else None
        finally:
            if metrics is not None:
                metrics.close(config.metrics.linger_seconds)
            # a rank gone or frozen would hold a closing barrier for engine.timeout_s more
            engine.close(keep_process_group=not last, peers_lost=isinstance(sys.exc_info()[1], PeerLost))


@contextmanager
def output_dir_lock(engine, directory: Path, unwritable: OutputNotWritable | None = None):
    """Rank 0 holds the output directory for the run; if another run holds it, or any rank cannot
    write its outputs (`unwritable`: found before the engine started), every rank refuses."""
    lock, error = None, unwritable
    if engine.is_main and error is None:
        try:
            lock = RunLock(directory).acquire()
        except (OutputDirInUse, OutputNotWritable) as err:
            error = err
    try:
        _raise_if_any_rank_failed(error, (OutputNotWritable, OutputDirInUse))
        yield
    finally:
        if lock is not None:
            lock.release()
