"""The training loop and its step: one code path for every recipe, engine and launcher.

fit() builds the model, streams batches, takes optimizer steps, checkpoints (every N steps and at
each epoch end, resumable to the exact batch) and hands the evaluations (evaluations.py: before
training, after epochs, the test of the best epoch, the results) their moments. On a stop request
(stopping.py) every rank finishes the same step, checkpoints it and raises TrainingStopped.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import closing
from dataclasses import asdict

import torch

from vldist.checkpoint.format import step_name
from vldist.checkpoint.manager import Checkpointer
from vldist.config import JobConfig
from vldist.data.device_prefetch import DevicePrefetch
from vldist.data.job_shards import JobShards
from vldist.data.streams import SkipReport, TrainingStreams
from vldist.distributed.collectives import gather_objects, global_sum
from vldist.distributed.heartbeat import heartbeat
from vldist.distributed.replicas import ReplicaCheck
from vldist.distributed.watchdog import Watchdog, watchdog_store
from vldist.errors import (
    ConfigError,
    EmptySplitError,
    NonFiniteLossError,
    TooManySkipped,
    TrainingStopped,
    UnreadableBatch,
)
from vldist.models.dropout import use_uniform_dropout_masks
from vldist.models.global_batchnorm import convert_global_batchnorm
from vldist.recipes.base import Recipe, StartingWeights
from vldist.store.location import redact
from vldist.telemetry.flops import FlopCounter, device_peak
from vldist.telemetry.profiling import StepProfiler
from vldist.telemetry.progress import TrainingProgress
from vldist.telemetry.trackers import Trackers
from vldist.training.activation_checkpointing import apply_activation_checkpointing
from vldist.training.compiling import StepCompiler
from vldist.training.evaluations import Evaluations
from vldist.training.negative_cache import NegativeCache
from vldist.training.optimizers import build_optimizers, build_scheduler
from vldist.training.run_state import RunState
from vldist.training.sample_log import SampleLog
from vldist.training.stopping import StopRequest, raise_if_interrupted

log = logging.getLogger("vldist.train")


class Trainer:
    def __init__(
        self,
        config: JobConfig,
        recipe: Recipe,
        engine,
        shards: JobShards,
        on_checkpoint=None,
        metrics=None,
        stop: StopRequest | None = None,
        start: StartingWeights | None = None,
    ):
        """shards: the job's shard sets; start: the weights the recipe starts from (its
        starts_from, read on each rank, on_each_rank.py); on_checkpoint, metrics: see Checkpointer."""
        self.config, self.recipe, self.engine = config, recipe, engine
        self.shards = shards.main  # evaluation's; the training streams take every set they read
        self.metrics = metrics  # this rank's Prometheus exporter (telemetry/prometheus.py), or None
        self.stop = stop or StopRequest()  # fed by signals (or a Ray driver's stop request) while training runs
        self.flops = FlopCounter(device_peak(engine.device, engine.precision) if metrics else None)
        self.out_dir = config.output_dir
        self.state = RunState()
        t = config.train
        self.accumulation = t.grad_accumulation
        slices = engine.world_size * self.accumulation
        if config.data.batch_size % slices:
            raise ConfigError(
                f"data.batch_size={config.data.batch_size} must be divisible by {engine.world_size} ranks x "
                f"train.grad_accumulation={self.accumulation}: each rank's micro-batch is batch_size / {slices}. "
                "The batch is the job's global batch, kept when a run resumes on another number of ranks: "
                "run on a number of ranks that divides it"
            )
        self.compiler = StepCompiler(config, recipe, engine)  # before the streams: it may pad their captions
        self.negative_cache = NegativeCache.for_job(config, recipe, engine)  # train.accumulate_negatives
        self.streams = TrainingStreams(
            config, recipe, shards, engine.rank, engine.world_size, self.accumulation, self.stop.signals
        )
        self.micro_per_epoch = self.streams.micro_per_epoch
        self.steps_per_epoch, self.total_steps = self.streams.steps_per_epoch, self.streams.total_steps
        self.epochs = self.streams.epochs

        torch.manual_seed(config.seed)  # identical initial weights on every rank
        model = recipe.build_model()
        recipe.initialize(model, start, shards)  # a resumed run's checkpoint then replaces these weights
        use_uniform_dropout_masks(model)  # CPU masks from one uniform draw, not bernoulli_: models/dropout.py
        if config.engine.sync_batchnorm and engine.world_size > 1:
            convert_global_batchnorm(model)
        self.optimizers = build_optimizers(config, recipe.optimizer_groups(model))
        if t.activation_checkpointing:  # in place too: the same parameter names and state_dict keys
            apply_activation_checkpointing(model, recipe, engine)
        self.compiler.compile_model(model)  # in place, before the engine wraps it: checkpoints keep their keys
        self.model = engine.setup(model, self.optimizers, dynamic_graph=recipe.dynamic_graph)
        if engine.rank:
            torch.manual_seed(config.seed + engine.rank)  # dropout masks differ between ranks
        self.schedulers = {
            name: build_scheduler(config, opt, self.steps_per_epoch, self.total_steps)
            for name, opt in self.optimizers.items()
        }
        self.checkpoints = Checkpointer(
            config, engine, self.schedulers, recipe, lambda: asdict(self.state), on_checkpoint, metrics
        )
        self.profiler = StepProfiler(
            t.profile_steps, config.output_dir / "profile", engine.device, engine.rank, engine.is_main
        )
        self.sample_log = SampleLog(t.sample_log, config.output_dir, engine.rank)
        self.replicas = ReplicaCheck(
            engine.unwrap(), engine.world_size, t.replica_check_every, config.engine.sync_batchnorm
        )

    def train_epoch(self, epoch: int) -> float:
        """The rest of one epoch (from the data position on resume); returns its mean loss."""
        self.ran_out = False
        if self.state.epoch_step >= self.steps_per_epoch or self.state.step >= self.total_steps:
            # resumed from a stop after this epoch's (or the run's) last step: only its end remains
            return self.state.epoch_loss_sum / self.state.epoch_step
        self.recipe.start_epoch(epoch)
        t = self.config.train
        self.model.train()
        # the data position: a resumed epoch's streams begin at the step reached (data/streams.py)
        first = sum(self.streams.positions(self.state.epoch_step).values())
        self.epoch_skips = SkipReport()  # this rank's, by shard: named when the epoch ends or the bound is passed
        try:
            self._train_batches(epoch, first, t)
        except UnreadableBatch:
            if self.state.epoch_step == 0:  # not one batch this epoch: the split, not a batch, is unreadable
                raise self._empty_epoch(epoch) from None
            raise
        self._count_trailing_skips()
        if self.state.epoch_step == 0:
            raise self._empty_epoch(epoch)
        # an exact epoch over shards that lack samples runs out early, at the same step on every rank
        self.ran_out = self.streams.ran_out and self.state.step < self.total_steps
        self._report_skips(epoch)
        return self.state.epoch_loss_sum / self.state.epoch_step

    def _count_trailing_skips(self) -> None:
        """The skips the loaders reported after the pass's last batch, every rank's (one all-reduce)."""
        trailing = self.streams.trailing_skips
        self.epoch_skips.add(trailing)
        with heartbeat.collective("all_reduce (skipped samples)"):
            self._count_skipped(int(global_sum(torch.tensor(trailing.count))))

    def _count_skipped(self, count: int) -> None:
        """Every rank's skipped samples: past data.max_skipped_fraction of an epoch, the run ends."""
        self.state.skipped_samples += count
        self.state.epoch_skipped += count
        bound = self.config.data.max_skipped_fraction
        if count and self.state.epoch_skipped > bound * self.streams.planned_samples:
            raise TooManySkipped(
                f"{self.state.epoch_skipped} of the {self.streams.planned_samples} samples of epoch "
                f"{self.state.epoch + 1} were unreadable and skipped by step {self.state.step}, more than "
                f"data.max_skipped_fraction={bound:g} allows. {self._where(self._skips_by_shard())}. "
                f"`python -m vldist.shards verify {redact(self.shards.directory)}` lists every problem: rebuild or "
                f"convert those shards again, or raise data.max_skipped_fraction to train on the rest; then "
                f"{self._restart_hint()}"
            )

    def _skips_by_shard(self) -> list[tuple[str, int]]:
        """The epoch's skipped samples by shard, every rank's, most first (an all-gather: every rank
        calls it at the same step, as the counts that lead here are global)."""
        merged = SkipReport()
        for each in gather_objects(self.epoch_skips.by_shard):
            merged.add(SkipReport(0, each))
        return sorted(merged.by_shard.items(), key=lambda kv: -kv[1])

    @staticmethod
    def _where(by_shard: list[tuple[str, int]]) -> str:
        if not by_shard:
            return "The warnings above give the reasons"
        named = ", ".join(f"{shard} ({n})" for shard, n in by_shard[:3])
        more = f" and {len(by_shard) - 3} more shards" if len(by_shard) > 3 else ""
        return f"They came from {named}{more}; the warnings above give the reasons"

    def _restart_hint(self) -> str:
        saved = self.checkpoints.saved()
        if saved:
            return (
                f"carry on from the last checkpoint, {saved[-1]}, with train.resume=latest (nothing was saved after it)"
            )
        return "start again (no checkpoint was written before it)"

    def _report_skips(self, epoch: int) -> None:
        """The epoch's sample accounting, when it skipped any: how many, from which shards, and
        whether the epoch ran out before its planned steps."""
        if not self.state.epoch_skipped and not self.ran_out:
            return
        by_shard = self._skips_by_shard() if self.state.epoch_skipped else []
        for shard, n in by_shard:
            self.state.skipped_by_shard[shard] = self.state.skipped_by_shard.get(shard, 0) + n
        if not self.engine.is_main:
            return
        ended = (
            f"; it ended after {self.state.epoch_step} of its {self.steps_per_epoch} steps, the shards holding fewer "
            "samples than their manifest lists"
            if self.ran_out
            else ""
        )
        log.warning(
            "epoch %d: %d of its %d samples were unreadable and skipped%s. %s",
            epoch + 1,
            self.state.epoch_skipped,
            self.streams.planned_samples,
            ended,
            self._where(by_shard),
        )

    def _train_batches(self, epoch: int, first: int, t) -> None:
        """The epoch's steps from its data position on (train_epoch)."""
        fetch_start, pending, step_skips = time.perf_counter(), [], SkipReport()
        sources = self.streams.source_names()
        from_sources: dict[str, int] = {}
        heartbeat.phase = "data"
        # closing: on an exception the loaders' workers end now, not at interpreter exit (split_evaluation.py)
        with closing(self.streams.batches(epoch, self.state.epoch_step)) as batches:
            # on CUDA the next batch's copy runs on a side stream during this step (device_prefetch.py)
            for index, batch in enumerate(DevicePrefetch(batches, self.engine.device), start=first):
                step_skips.add_batch(batch)
                for source, n in batch.pop("source_counts", {}).items():  # data.sources: this rank's rows of each
                    from_sources[source] = from_sources.get(source, 0) + n
                pending.append(batch)
                if len(pending) < self.accumulation and index + 1 < self.micro_per_epoch:
                    continue
                wait = time.perf_counter() - fetch_start  # blocked on the loader, not computing
                step_start = time.perf_counter()
                heartbeat.step_started()
                # the FLOP count: the first step only, on CUDA only; the profile: train.profile_steps
                trains = (tuple(b.get("stream", "main") for b in pending), self.recipe.updates(self.state.step))
                with (
                    self.flops.measure() as counter,
                    self.profiler.step(self.state.step + 1),
                    self.compiler.watch(trains),
                ):
                    losses = self._step(pending)
                # the last exact-epoch batch can be ragged, so count rather than assume
                local = sum(_batch_size(b) for b in pending)
                self.flops.counted(counter, local)
                # One all-reduce: the global sample count, the samples every rank skipped as corrupt,
                # whether any rank was asked to stop (a signal may reach one rank only; all then stop
                # after this same step), and with data.sources every source's rows.
                with heartbeat.collective("all_reduce (samples, stop)"):
                    skipped = step_skips.count
                    counts = [local, skipped, int(self.stop.requested), *(from_sources.get(s, 0) for s in sources)]
                    n, skipped_here, stopping, *by_source = (int(v) for v in global_sum(torch.tensor(counts)))
                if self.engine.device.type == "cuda":
                    torch.cuda.synchronize(self.engine.device)  # kernels run async: time the step, not its launch
                step_seconds = time.perf_counter() - step_start
                heartbeat.step_done(self.state.step + 1, step_seconds, wait)
                self._observe_step(local, step_seconds, wait, losses, skipped, from_sources)
                for source, count in zip(sources, by_source, strict=True):
                    self.state.samples_by_source[source] = self.state.samples_by_source.get(source, 0) + count
                from_sources = {}
                self.sample_log.record(epoch, self.state.step + 1, pending)
                self.epoch_skips.add(step_skips)
                pending, step_skips = [], SkipReport()
                self.state.step += 1
                self.profiler.step_done(self.state.step)
                self.state.epoch_step += 1
                self.state.data_position = self.streams.data_position(epoch, self.state.epoch_step)
                self.state.epoch_loss_sum += float(losses["loss"])
                self.state.samples_seen += n
                self.progress.step(
                    epoch=epoch,
                    step=self.state.step,
                    samples=n,
                    wait=wait,
                    losses=losses,
                    lr=self.current_lr(),
                    note=self.watchdog.straggler,
                    recompilations=self.compiler.recompilations if self.compiler.enabled else None,
                    sources=self.state.samples_by_source or None,
                    cuda_peak_memory_bytes=torch.cuda.max_memory_allocated(self.engine.device)
                    if self.engine.device.type == "cuda"
                    else None,
                )
                if self.replicas.due(self.state.step):  # before a checkpoint could keep a diverged copy
                    with heartbeat.collective("all_gather (replica check)"):
                        self.replicas.check(self.state.step)
                if (
                    t.save_every_steps
                    and self.state.step % t.save_every_steps == 0
                    and self.state.step < self.total_steps
                ):
                    self.checkpoints.save_step(self.state.step, self.state.epoch)
                self._count_skipped(skipped_here)  # every rank's: metrics.json is rank 0's
                if stopping:
                    self._stop()
                raise_if_interrupted()
                if self.state.step >= self.total_steps or self.state.epoch_step >= self.steps_per_epoch:
                    break
                fetch_start = time.perf_counter()
                heartbeat.phase = "data"

    def _empty_epoch(self, epoch: int) -> EmptySplitError:
        return EmptySplitError(
            f"epoch {epoch + 1} yielded no training batches: every sample of the {self.config.data.train_split} "
            f"split of {redact(self.shards.directory)} was skipped as unreadable, or the split is empty (the warnings "
            f"above give the first reasons). `python -m vldist.shards verify {redact(self.shards.directory)}` lists "
            "every problem."
        )

    def _observe_step(
        self, samples: int, seconds: float, wait: float, losses: dict, skipped: int, sources: dict[str, int]
    ) -> None:
        if self.metrics is None:
            return
        self.metrics.observe_step(
            samples=samples,
            step_seconds=seconds,
            wait_seconds=wait,
            losses=losses,
            lr=self.current_lr(),
            grad_norm=losses["grad_norm"],
            skipped=skipped,
            own_seconds=heartbeat.last.own,
            recompilations=self.compiler.recompilations,
            sources=sources,
        )
        if self.engine.device.type == "cuda":
            self.metrics.set_device(
                cuda_memory_bytes=torch.cuda.memory_allocated(self.engine.device), mfu=self.flops.mfu(samples, seconds)
            )

    def current_lr(self) -> float:
        return next(iter(self.schedulers.values())).get_last_lr()[0]

    def _step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step per update the recipe asks for, each accumulated over the micro-batches.
        Logged values are global: the mean over micro-batches of the summed rank shares (with
        train.accumulate_negatives, the whole global batch's loss)."""
        logged: dict[str, float] = {}
        self.recipe.start_step(self.state.step)
        for update in self.recipe.updates(self.state.step):
            prefix = "" if update == "main" else f"{update}/"
            if len(self.optimizers) > 1:
                # An update's backward may reach parameters another optimizer owns (a GAN's generator
                # loss flows through the discriminator); those gradients must not carry over.
                self.model.zero_grad(set_to_none=True)
            if self.negative_cache is not None:  # the cross-batch loss over every micro-batch at once
                summed = self.negative_cache.accumulate(self.model, micro_batches, update, self._global_finite)
            else:
                summed = self._accumulate(micro_batches, update)
            for k, v in summed.items():
                logged[prefix + k] = logged.get(prefix + k, 0.0) + v
            with heartbeat.phase_of(f"optimizer step ({update})"):
                logged[prefix + "grad_norm"] = self.engine.step(update, self.config.train.grad_clip)
            self.schedulers[update].step()
        logged.setdefault("loss", sum(v for k, v in logged.items() if k.endswith("/loss")))
        logged.setdefault("grad_norm", max(v for k, v in logged.items() if k.endswith("grad_norm")))
        return logged

    def _accumulate(self, micro_batches: list[dict], update: str) -> dict[str, float]:
        """Each micro-batch's forward and backward; returns the mean of their global losses."""
        logged: dict[str, float] = {}
        for i, batch in enumerate(micro_batches):
            with self.engine.micro_batch(last=i == len(micro_batches) - 1):
                with self.engine.autocast(), heartbeat.phase_of(f"forward ({update})"):
                    losses = self.compiler.training_losses(self.model, batch, update)
                summed = self._global_finite(losses, update)
                with heartbeat.phase_of(f"backward ({update})"):
                    self.engine.backward(losses["loss"], len(micro_batches))
            for k, v in summed.items():
                logged[k] = logged.get(k, 0.0) + v / len(micro_batches)
        return logged

    def _global_finite(self, losses: dict, update: str) -> dict[str, float]:
        """The global values of this rank's loss shares, after checking they are finite. All ranks
        check the same sum, so on a NaN they stop together instead of one waiting in a collective."""
        with heartbeat.collective("all_reduce (loss)"):  # .tolist() inside: on CUDA that is where it waits
            totals = global_sum(
                torch.stack([v.detach().float().reshape(()) for v in losses.values()])
            )  # one all-reduce
            summed = dict(zip(losses, totals.tolist(), strict=True))
        if not math.isfinite(summed["loss"]):
            parts = ", ".join(f"{k}={v:.4g}" for k, v in summed.items())
            raise NonFiniteLossError(
                f"non-finite loss at step {self.state.step + 1}, update '{update}' ({parts}). Lower train.lr or set "
                f"train.grad_clip, check the shards for bad features, and {self._restart_hint()}."
            )
        return summed

    def fit(self) -> dict:
        """Train, validate and test (see the module docstring), watched by the hang and straggler
        watchdog (distributed/watchdog.py)."""
        t = self.config.train
        resume_hint = (
            f"with train.resume=auto it carries on from the newest checkpoint in {self.checkpoints.directory}."
        )
        self.trackers = Trackers.start(self.config, self.engine.is_main)  # rank 0's, if the job lists any
        store = watchdog_store(timeout_s=2 * Watchdog.interval_for(t.hang_timeout_s) + 5)
        self.watchdog = Watchdog(
            heartbeat, store, self.engine.rank, self.engine.world_size, t.hang_timeout_s, t.straggler_ratio, resume_hint
        ).start()
        try:
            return self._fit()
        finally:
            self.streams.close()  # the loaders' workers end now, however the run ended
            if getattr(self, "evaluations", None) is not None:
                self.evaluations.close()
            self.profiler.close()  # a run that ended inside the window keeps what it recorded
            self.watchdog.stop()
            if self.trackers is not None:
                self.trackers.close()

    def _fit(self) -> dict:
        cfg = self.config
        start = time.perf_counter()
        self._resume()
        self.progress = TrainingProgress(
            self.engine.is_main,
            self.total_steps,
            self.state.step,
            cfg.train.log_every,
            self.out_dir / "metrics.jsonl",
            self.trackers.record if self.trackers else None,
        )
        self.evaluations = Evaluations(
            cfg, self.recipe, self.engine, self.shards, self.stop, self.checkpoints, self.progress, self.trackers
        )
        if self.state.step < self.total_steps:  # the workers start and fill their buffers meanwhile
            if self.state.epoch_step >= self.steps_per_epoch:
                self.streams.begin(self.state.epoch + 1)
            else:
                self.streams.begin(self.state.epoch, self.state.epoch_step)
        self.evaluations.before_training(self.state)
        while not self._run_done() or self._epoch_end_pending():
            epoch = self.state.epoch
            train_loss = self.train_epoch(epoch)
            self._end_of_epoch(epoch, train_loss)
            if bool(global_sum(torch.tensor(int(self.stop.requested)))):  # asked during validation
                self._stop()
        self.checkpoints.finish()  # the last checkpoint committed before the run reports
        self.progress.close()
        train_seconds = time.perf_counter() - start
        return self.evaluations.results(self.state, start, train_seconds)

    def _resume(self) -> None:
        """The run state of the checkpoint train.resume names, if any (the checkpointer restores
        the model, optimizers and schedulers)."""
        restored = self.checkpoints.load()
        if restored is None:
            return
        self.state = RunState(**restored)
        heartbeat.step = self.state.step
        self.state.restarts += 1
        if self.metrics is not None:
            self.metrics.set_restarts(self.state.restarts)

    def _run_done(self) -> bool:
        """Its steps taken, or, without train.max_steps, its epochs (one may have run out early)."""
        epochs_done = self.config.train.max_steps is None and self.state.epoch >= self.epochs
        return self.state.step >= self.total_steps or epochs_done

    def _epoch_end_pending(self) -> bool:
        """A stop after an epoch's last step checkpointed before the epoch's end (validation, best
        snapshot) ran; a resumed run does that first."""
        last = self.state.history[-1]["step"] if self.state.history else 0
        return self.state.epoch_step > 0 and last != self.state.step

    def _stop(self) -> None:
        """Every rank, together: checkpoint the step reached (unless that is done) and stop."""
        reasons = [r for r in gather_objects(self.stop.reason) if r]
        reason = reasons[0] if reasons else "a stop request"
        # A rank that learnt of the stop from the all-reduce records it too: its signals then stay
        # ignored until it exits, so the launcher's SIGTERM after another rank left cannot kill it
        # with -15 instead of exit_codes.STOPPED (stopping.py).
        self.stop.reason = self.stop.reason or reason
        self.checkpoints.finish()  # an asynchronous save in flight (perhaps of this very step)
        if self.checkpoints.saved_step != self.state.step:
            self.checkpoints.save_step(self.state.step, self.state.epoch, wait=True)
        checkpoint = self.checkpoints.path(step_name(self.state.step))
        self.progress.write(f"stopped by {reason} after step {self.state.step}: checkpoint {checkpoint}")
        self.progress.record(
            {"event": "stopped", "step": self.state.step, "reason": reason, "checkpoint": str(checkpoint)}
        )
        self.progress.close()
        raise TrainingStopped(self.state.step, checkpoint, reason)

    def _end_of_epoch(self, epoch: int, train_loss: float) -> None:
        """After an epoch, or after the last step (which may fall mid-epoch: then the data position
        is kept, so that a later run with more steps carries on from the same batch)."""
        entry = {"epoch": epoch + 1, "step": self.state.step, "train_loss": train_loss}
        if self.state.epoch_skipped:
            entry["skipped_samples"] = self.state.epoch_skipped
        finished = self.state.epoch_step >= self.steps_per_epoch or self.ran_out
        if finished:
            self.state.epoch, self.state.epoch_step, self.state.epoch_loss_sum = epoch + 1, 0, 0.0
            self.state.epoch_skipped = 0
            self.state.data_position = self.streams.data_position(epoch + 1, 0)
        self.state.history.append(entry)
        last = self._run_done()
        self.evaluations.after_epoch(self.state, epoch, entry, finished, last)
        self.checkpoints.save_step(self.state.step, self.state.epoch, final=last)


def _batch_size(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
