"""What a training run evaluates, keeps and reports: the recipe's evaluation checked before
training (or the untrained baseline), validation after the epochs train.validate_every names and
after the last step, the best epoch by the recipe's selection score (its weights kept as the "best"
checkpoint), and at the end the test evaluation of those weights and the run's results
(metrics.json).

Rank 0 evaluates: the retrieval protocol ranks every image against every caption in one matrix,
and every rank holds the whole model. The others wait, and learn the score that picks the best
epoch from one all-reduce, so that every rank agrees on it.

The validation split's loader is built once and keeps its workers from one validation to the next;
the others (baseline, contract check, test) are read once or twice and end theirs after each read.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from itertools import islice

import torch

from vldist.checkpoint.format import load_model_state
from vldist.checkpoint.manager import Checkpointer
from vldist.config import JobConfig
from vldist.data.pipeline import Loader
from vldist.data.shardset import ShardSet
from vldist.distributed.collectives import global_sum
from vldist.distributed.heartbeat import heartbeat
from vldist.recipes.base import Recipe
from vldist.telemetry.progress import TrainingProgress, eval_batches
from vldist.telemetry.trackers import Trackers
from vldist.training.run_state import RunState
from vldist.training.split_evaluation import eval_batch_count, eval_loader, evaluate_split
from vldist.training.stopping import StopRequest, raise_if_interrupted

log = logging.getLogger("vldist.train")


class Evaluations:
    def __init__(
        self,
        config: JobConfig,
        recipe: Recipe,
        engine,
        shards: ShardSet,
        stop: StopRequest,
        checkpoints: Checkpointer,
        progress: TrainingProgress,
        trackers: Trackers | None,
    ):
        self.config, self.recipe, self.engine, self.shards = config, recipe, engine, shards
        self.stop, self.checkpoints, self.progress, self.trackers = stop, checkpoints, progress, trackers
        self.kept: dict[str, Loader] = {}  # the validation split's persistent loader, once built
        # seconds spent in each kind of evaluation: metrics.json's `evaluation_seconds`, so that a
        # run's wall time splits into training and evaluating (bench/demo_times.py)
        self.seconds: dict[str, float] = {}

    def close(self) -> None:
        """End the workers of the loaders kept between validations."""
        for loader in self.kept.values():
            loader.close()
        self.kept = {}

    def before_training(self, state: RunState) -> None:
        """A new run: the untrained model's evaluation (eval.baseline), else the contract check."""
        if state.step:
            return
        if not self.config.eval.baseline:
            with self._timed("contract_check"):
                self.check_contract()  # the baseline evaluation is checked as it runs
            return
        with self._timed("baseline"):
            state.untrained = self.evaluate(self.config.eval.split, state.step)
        if self.engine.is_main:
            log.info("untrained model on %s: %s", self.config.eval.split, _short(self.recipe.headline(state.untrained)))

    def after_epoch(self, state: RunState, epoch: int, entry: dict, finished: bool, last: bool) -> None:
        """Validate after a finished epoch that train.validate_every names, and after the run's last
        step; keep the weights as the best epoch's when the score beats every earlier one."""
        every = self.config.train.validate_every
        if not every or not ((finished and (epoch + 1) % every == 0) or last):
            return
        with self._timed("validation"):
            val = self.evaluate(self.config.data.val_split, state.step)
        # Rank 0 measured; share its score so every rank agrees on the best epoch.
        score = float(global_sum(torch.tensor(self.recipe.selection_score(val) if val else 0.0, dtype=torch.float64)))
        if val:
            entry["val"] = self.recipe.headline(val)
            self.progress.write(f"epoch {epoch + 1} validation: {_short(entry['val'])}")
            self.progress.record({"event": "validation", "epoch": epoch + 1, "step": state.step, **entry["val"]})
            self._caption_examples("val", state.step, val)
        if score > state.best_score:
            state.best_score, state.best_epoch = score, epoch + 1
            self.checkpoints.save("best", entry)

    def results(self, state: RunState, started: float, train_seconds: float) -> dict:
        """The best epoch's weights (the last ones if none was chosen) evaluated on the test split,
        with what the run did: the results rank 0 writes to metrics.json and returns."""
        best = self.checkpoints.path("best")
        if state.best_epoch is not None and best.is_dir():
            self.engine.load_model_state(load_model_state(best))
        cfg = self.config
        results: dict = {
            "recipe": cfg.recipe,
            "world_size": self.engine.world_size,
            "precision": self.engine.precision,  # what engine.mixed_precision ran as (auto resolved)
            "config": cfg.model_dump(mode="json"),
        }
        if state.untrained is not None:
            results["untrained"] = state.untrained
        self.close()  # no more validations
        with self._timed("test"):
            results["test"] = self.evaluate(cfg.eval.split, state.step)
        if results["test"]:
            self.progress.record({"event": "test", "step": state.step, **self.recipe.headline(results["test"])})
            self._caption_examples("test", state.step, results["test"])
        results.update(
            steps=state.step,
            samples_seen=state.samples_seen,
            skipped_samples=state.skipped_samples,
            skipped_by_shard=state.skipped_by_shard,
            best_epoch=state.best_epoch,
            restarts=state.restarts,
            history=state.history,
            train_seconds=train_seconds,
            wall_seconds=time.perf_counter() - started,
            evaluation_seconds=dict(self.seconds),
        )
        if state.skipped_samples and self.engine.is_main:
            log.warning("skipped %d unreadable samples during training", state.skipped_samples)
        if self.engine.is_main:
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            (cfg.output_dir / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
        return results

    @contextmanager
    def _timed(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start

    def evaluate(self, split: str, step: int) -> dict | None:
        """Metrics on rank 0 (None elsewhere); the other ranks wait."""
        with heartbeat.phase_of(f"evaluation ({split})"):
            return self._evaluate(split, step)

    def check_contract(self) -> None:
        """The recipe's evaluation on the first batch of the validation split, checked against the
        contract (recipes/contract.py), so that a recipe returning the wrong thing stops before
        training rather than after it. Random state is restored: training draws what it would have."""
        split = self.config.data.val_split
        if not self.shards.num_samples(split):  # a set without one: its evaluation split, unselected
            split = self.config.eval.split
        devices = [self.engine.device] if self.engine.device.type == "cuda" else []
        with heartbeat.phase_of("evaluation (contract check)"), torch.random.fork_rng(devices=devices):
            self._evaluate(split, 0, batches=1, validation=split == self.config.data.val_split)

    def _evaluate(
        self, split: str, step: int, batches: int | None = None, validation: bool | None = None
    ) -> dict | None:
        result = None
        model = self.engine.evaluation_model(self.recipe.build_model)  # collective
        if self.engine.is_main:
            loader = self._loader(split, whole=batches is None)
            count = eval_batch_count(self.config, self.shards, split)
            loaded = heartbeat.beating(loader if batches is None else islice(loader, batches))
            where = f"the {split} split of {self.shards.directory}"
            if validation is None:
                validation = split == self.config.data.val_split and split != self.config.eval.split
            pictures = None if batches else self.config.output_dir / "images" / f"{split}-step-{step:08d}"
            result = evaluate_split(
                self.recipe,
                model,
                eval_batches(loaded, batches or count, split, True),
                self.engine.device,
                where,
                validation,
                pictures,
            )
            raise_if_interrupted()
        with heartbeat.collective("barrier (rank 0 evaluates)"):
            self.engine.barrier()
        return result

    def _loader(self, split: str, whole: bool) -> Loader:
        """The validation split's kept loader for a whole read of it; a loader of its own otherwise."""
        if not whole or split != self.config.data.val_split:
            return eval_loader(self.config, self.recipe, self.shards, split, self.stop.signals)
        if split not in self.kept:
            self.kept[split] = eval_loader(self.config, self.recipe, self.shards, split, self.stop.signals, True)
        return self.kept[split]

    def _caption_examples(self, split: str, step: int, metrics: dict) -> None:
        """A captioning evaluation's generated captions, as a table in the trackers."""
        if self.trackers is not None and metrics.get("examples"):
            self.trackers.examples(split, step, metrics["examples"])


def _short(metrics: dict) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in metrics.items())
