"""Checkpoints of a training run: written by every rank together, pruned, found and restored.

The trainer hands a Checkpointer its stateful parts once (the engine, which holds the model and the
optimizers, the LR schedulers, the recipe's vocabulary and feature width, and a way to read the
run's own state) and then only calls `save_step` / `save` / `load`. The files themselves, their
checksums and the atomic commit are format.py's.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vldist.checkpoint.format import (
    STEP_PREFIX,
    begin,
    check_checkpoint_fits_job,
    check_engine_fits,
    commit,
    is_complete,
    load_model_state,
    load_train_state,
    prune,
    read_meta,
    step_checkpoints,
    step_name,
    temporary_path,
    verify,
    write_failed,
    write_files,
)
from vldist.checkpoint.object_store import CheckpointStore
from vldist.checkpoint.sharded_state import SHARDED_DIR
from vldist.config import JobConfig, to_yaml
from vldist.distributed.collectives import gather_objects
from vldist.distributed.heartbeat import heartbeat
from vldist.errors import CheckpointError

log = logging.getLogger("vldist.train")


class Checkpointer:
    """config: the job (train.resume, train.keep_last; saved as config.yaml); engine: saves and
    loads the model and optimizer state; schedulers: the LR schedulers by optimizer name; recipe:
    its vocabulary and feature width go into each checkpoint, and a checkpoint must fit the model
    it builds; run_state: the run's own state (step, data position, history) as a dict.
    on_checkpoint(path, meta): called on every rank after each step checkpoint (Ray reports it);
    metrics: the rank's exporter (save times, restarts), or None."""

    def __init__(
        self,
        config: JobConfig,
        engine,
        schedulers: dict,
        recipe,
        run_state: Callable[[], dict],
        on_checkpoint=None,
        metrics=None,
    ):
        self.config, self.engine, self.schedulers, self.recipe = config, engine, schedulers, recipe
        self.run_state, self.on_checkpoint, self.metrics = run_state, on_checkpoint, metrics
        self.directory = config.output_dir / "checkpoints"
        self.saved_step: int | None = None  # the step of the newest step checkpoint this process wrote
        self.pending: PendingSave | None = None  # a save whose files are still being written
        out = config.output
        self.store = CheckpointStore(out.checkpoint_dir, out.storage_options) if out.checkpoint_dir else None

    def path(self, name: str) -> Path:
        return self.directory / name

    def saved(self) -> list[Path]:
        """The committed step checkpoints, oldest first."""
        return step_checkpoints(self.directory)

    # ------------------------------------------------------------------ writing

    def save_step(self, step: int, epoch: int, final: bool = False, wait: bool = False) -> Path:
        """Collective. Checkpoint `step` as step-NNNNNNNN; once it is committed, prune to
        train.keep_last and tell the launcher. `final`: the run's last, which holds the whole
        weights in every format; `wait`: return only once it is committed, even when saves are
        asynchronous (a stop: the process exits next). Returns its path."""
        # final: the run trained every step it was asked for (a Ray resubmission is refused, not resumed)
        meta = {"step": step, "epoch": epoch, "final": final}
        name = step_name(step)
        self.save(name, meta, full_weights=final, wait=wait)
        return self.path(name)

    def save(self, name: str, meta: dict, full_weights: bool = True, wait: bool = True) -> None:
        """Collective. Rank 0 opens a temporary directory, every rank writes its part (DeepSpeed or
        DCP shards), rank 0 adds the rest and commits: the checkpoint appears whole or not at all.
        A write that fails on any rank (a full disk) fails the save on every rank together.
        With train.async_checkpoints the files are written in the background and this returns
        once the state is copied (unless `wait`); the next save, or `finish`, waits for it."""
        with heartbeat.phase_of(f"checkpoint {name}"):
            start = time.perf_counter()
            self.finish()  # one save in flight at most
            self._save(name, meta, full_weights or self.config.train.checkpoint_format == "plain")
            if wait or not self.config.train.async_checkpoints:
                self.finish()
            if self.metrics is not None:
                self.metrics.observe_checkpoint(time.perf_counter() - start)  # the time training was held

    def _save(self, name: str, meta: dict, full_weights: bool) -> None:
        directory, engine = self.path(name), self.engine
        tmp, main = temporary_path(directory), engine.is_main
        # What the checkpoint records is read now, in step with training; only the writing waits.
        rng_states = gather_objects(torch.get_rng_state())
        model_state = engine.model_state_dict() if full_weights else None  # whole weights on rank 0
        train_state = {
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
            "rng": rng_states,
            "run": self.run_state(),
        }
        meta = {
            **meta,
            "recipe": self.config.recipe,
            "world_size": engine.world_size,
            "engine": self.config.engine.backend,
            **engine.checkpoint_meta(),
            "format": self.config.train.checkpoint_format,
            "feature_dim": self.recipe.feature_dim,
            "vocab_size": len(self.recipe.vocab),
        }
        asynchronous = self.config.train.async_checkpoints
        self._write_together(directory, (lambda: begin(directory)) if main else None)
        written = None  # the background write of every rank's shards (DCP), if asynchronous
        snapshot = None  # rank 0's optimizer state, copied for a background write (plain format)
        if self.config.train.checkpoint_format == "sharded":
            holder = []
            self._write_together(directory, lambda: holder.append(engine.save_sharded(tmp / SHARDED_DIR, asynchronous)))
            written = holder[0] if holder else None
        elif asynchronous:
            snapshot = engine.training_state_snapshot()
        else:
            self._write_together(directory, lambda: engine.save_training_state(tmp))  # every rank's files

        def write_rest() -> None:
            if written is not None:
                written.result()  # every rank's shards and DCP's metadata are on disk
            if snapshot is not None:
                engine.write_training_state(tmp, snapshot)
            write_files(
                tmp,
                model_state=model_state,
                train_state=train_state,
                config_yaml=to_yaml(self.config),
                vocab=self.recipe.vocab,
                meta=meta,
            )
            commit(tmp, directory)
            if self.store is not None:
                self._upload(directory)

        self.pending = PendingSave(
            directory, meta, write_rest if main else written.result if written else None, background=asynchronous
        )

    def _upload(self, directory: Path) -> None:
        """Rank 0: the committed `directory` into the store (COMPLETE last), then the store pruned."""
        try:
            self.store.upload(directory)
            self.store.prune(self.config.train.keep_last)
        except Exception as err:  # noqa: BLE001 - fsspec stores raise many types
            newest = self.store.step_checkpoints()
            raise RuntimeError(
                f"uploading it to {self.store.where(directory.name)} failed ({type(err).__name__}: {err}); it is complete "
                f"on local disk, and the store's newest complete checkpoint is {newest[-1] if newest else 'none'}"
            ) from err

    def finish(self) -> None:
        """Collective. Wait for the save in flight, if any, on every rank, and agree that it
        succeeded (else raise, naming the previous checkpoint, which is intact); then prune and
        tell the launcher. The agreement is also the barrier: no rank reads a checkpoint still
        being written."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        self._agree(pending.directory, pending.error())
        if pending.meta.get("step") is not None and pending.directory.name.startswith("step-"):
            self.saved_step = pending.meta["step"]
            if self.engine.is_main:
                prune(self.directory, self.config.train.keep_last)
            if self.on_checkpoint is not None:
                self.on_checkpoint(pending.directory, {"step": pending.meta["step"], "epoch": pending.meta["epoch"]})

    def _write_together(self, directory: Path, write) -> None:
        """Collective: run this rank's part of a checkpoint write, then agree that all succeeded."""
        error = None
        if write is not None:
            try:
                write()
            except Exception as err:  # noqa: BLE001 - a full disk surfaces as OSError, RuntimeError (torch) or SafetensorError
                error = f"{type(err).__name__}: {err}"
        self._agree(directory, error)

    def _agree(self, directory: Path, error: str | None) -> None:
        errors = [e for e in gather_objects(error) if e]
        if not errors:
            return
        if self.engine.is_main:
            shutil.rmtree(temporary_path(directory), ignore_errors=True)  # give the space back
        raise write_failed(directory, errors[0], self.directory)

    # ------------------------------------------------------------------ reading

    def load(self) -> dict | None:
        """Collective. Restore the checkpoint train.resume names (latest/auto: the newest good one
        of this run) into the engine and schedulers; returns its run state (None: a fresh start)."""
        how = self.config.train.resume
        if how is None:
            return None
        candidates = [Path(how)] if how not in ("latest", "auto") else self._newest_first()
        where = self.directory if self.store is None else f"{self.directory} or {self.store.where('')}"
        if not candidates and how == "auto":
            log.info("train.resume=auto: no checkpoint in %s, starting fresh", where)
            return None
        for path in candidates:
            try:
                self._fetch(path)
                return self._restore(path)
            except CheckpointError as err:  # damaged: fall back to the previous good one
                if self.engine.is_main:
                    log.warning("cannot resume from %s (%s); trying an earlier checkpoint", path, err)
        raise CheckpointError(f"train.resume={how}: no usable checkpoint in {where}")

    def _newest_first(self) -> list[Path]:
        """The run's complete step checkpoints on local disk and in the store, newest first."""
        names = {p.name for p in self.saved()} | set(self.store.step_checkpoints() if self.store else [])
        return [self.path(n) for n in sorted(names, key=lambda n: int(n[len(STEP_PREFIX) :]), reverse=True)]

    def _fetch(self, path: Path) -> None:
        """Collective. A checkpoint the local disk lacks, downloaded from the store by the first rank
        of every node; all ranks agree on the outcome (CheckpointError: fall back together)."""
        if self.store is None:
            return
        error = None
        if self.engine.local_rank == 0 and not is_complete(path):
            try:
                self.store.download(path.name, path)
                log.info("downloaded %s into %s", self.store.where(path.name), path)
            except Exception as err:  # noqa: BLE001 - the store's errors, or a damaged download
                error = f"{type(err).__name__}: {err}"
        errors = [e for e in gather_objects(error) if e]
        if errors:
            raise CheckpointError(f"cannot download {self.store.where(path.name)}: {errors[0]}")
        self.engine.barrier()

    def _restore(self, path: Path) -> dict:
        # Every rank checks every file first and so reaches the same verdict: a damaged
        # checkpoint is skipped by all ranks together, before any collective load starts.
        verify(path)
        # Another model than this job builds is refused with the reason (IncompatibleCheckpoint is
        # no CheckpointError: an older checkpoint of the same run would not fit either).
        check_checkpoint_fits_job(
            path,
            self.recipe.build_model,
            self.config.model_dump(mode="json"),
            self.recipe.feature_dim,
            len(self.recipe.vocab),
            "resume from",
        )
        meta = read_meta(path)
        check_engine_fits(path, meta, self.config.engine.backend)
        train_state = load_train_state(path)
        if not (path / SHARDED_DIR).is_dir():  # a sharded checkpoint's weights load with its optimizer state
            self.engine.load_model_state(load_model_state(path))
        self.engine.load_training_state(path, meta)
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(train_state["schedulers"][name])
        run = train_state["run"]
        saved_world = meta.get("world_size", len(train_state["rng"]))
        torch.set_rng_state(
            rank_rng_state(train_state["rng"], self.engine.rank, self.engine.world_size, self.config.seed, run["step"])
        )
        if self.engine.is_main:
            resized = (
                f"; written by {saved_world} ranks, resumed on {self.engine.world_size} (global batch "
                f"{self.config.data.batch_size}, {self.config.data.batch_size // self.engine.world_size} a rank; "
                "each rank's random streams reseeded from seed, rank and step)"
                if saved_world != self.engine.world_size
                else ""
            )
            log.info(
                "resumed from %s at step %d (epoch %d, batch %d)%s",
                path,
                run["step"],
                run["epoch"] + 1,
                run["epoch_step"],
                resized,
            )
        return run


def rank_rng_state(saved: list[torch.Tensor], rank: int, world_size: int, seed: int, step: int) -> torch.Tensor:
    """The RNG state `rank` resumes with. On the world size that saved it, the rank's own state: the
    run continues bit for bit. On another, no saved state belongs to this rank (and handing one rank's
    to two would give them the same dropout masks): every rank starts a fresh generator seeded by
    (seed, rank, step), distinct between ranks and the same on every resume of this checkpoint."""
    if len(saved) == world_size:
        return saved[rank]
    digest = hashlib.sha256(f"vldist-rng/{seed}/{rank}/{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1).get_state()


class PendingSave:
    """This rank's part of a save still to finish: `write` (rank 0: the rest of the files and the
    commit; other ranks: waiting for their DCP shards), run now or, when `background`, in a thread
    while training goes on. error() waits for it and returns what went wrong, if anything."""

    def __init__(self, directory: Path, meta: dict, write, background: bool):
        self.directory, self.meta, self._error = directory, meta, None
        self._thread = None
        if write is None:
            return
        if background:
            # A daemon: a run that crashes meanwhile exits without its newest checkpoint (the
            # previous one is complete), instead of hanging on a write whose peers are gone.
            self._thread = threading.Thread(target=self._run, args=(write,), name=f"save {directory.name}", daemon=True)
            self._thread.start()
        else:
            self._run(write)

    def _run(self, write) -> None:
        try:
            write()
        except Exception as err:  # noqa: BLE001 - as in Checkpointer._write_together
            self._error = f"{type(err).__name__}: {err}"

    def error(self) -> str | None:
        if self._thread is not None:
            self._thread.join()
        return self._error
