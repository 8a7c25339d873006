"""The training loop: one code path for every recipe and every engine.

fit() builds the model, streams batches, takes optimizer steps, validates each epoch (keeping the
best snapshot by validation rsum, as VSRN does), and evaluates the best snapshot on the test split.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vldist.checkpoint import load_model_state, save_checkpoint
from vldist.config import JobConfig, to_yaml
from vldist.data.pipeline import EvalStream, StreamSpec, TrainStream, batches_per_rank, make_loader
from vldist.data.shardset import ShardSet
from vldist.losses.distributed import global_sum
from vldist.recipes.base import Recipe

log = logging.getLogger("vldist.train")


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; nothing was written after the last good checkpoint."""


@dataclass
class RunState:
    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    skipped_samples: int = 0
    best_score: float = -math.inf
    best_epoch: int | None = None
    history: list[dict] = field(default_factory=list)


def build_optimizer(config: JobConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    t = config.train
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=t.lr, weight_decay=t.weight_decay)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class Trainer:
    def __init__(self, config: JobConfig, recipe: Recipe, engine, shards: ShardSet):
        self.config, self.recipe, self.engine, self.shards = config, recipe, engine, shards
        self.out_dir = config.output_dir
        self.state = RunState()
        t = config.train
        world = engine.world_size
        if config.data.batch_size % world:
            raise ValueError(f"data.batch_size={config.data.batch_size} must be divisible by the {world} ranks")
        samples = t.samples_per_epoch or shards.num_samples(config.data.train_split)
        if samples is None:
            raise ValueError("the shard set has no manifest count for the train split; set train.samples_per_epoch")
        self.steps_per_epoch = batches_per_rank(samples, config.data.batch_size)
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)

        torch.manual_seed(config.seed)  # identical initial weights on every rank
        self.model, self.optimizer = engine.setup(recipe.build_model(), lambda m: build_optimizer(config, m))
        self.scheduler = torch.optim.lr_scheduler.StepLR(
            self.optimizer, step_size=t.lr_decay_epochs * self.steps_per_epoch, gamma=t.lr_decay_factor
        )
        self.train_stream = TrainStream(
            self._spec(config.data.train_split, train=True), self.steps_per_epoch, config.data.shuffle_buffer
        )

    def _spec(self, split: str, train: bool) -> StreamSpec:
        r, d = self.recipe, self.config.data
        return StreamSpec(
            urls=self.shards.urls(split),
            keep=r.sample_keys,
            sample_fn=r.train_sample if train else r.eval_sample,
            collate_fn=r.collate_train if train else r.collate_eval,
            batch_size=d.batch_size // self.engine.world_size if train else d.eval_batch_size,
            seed=self.config.seed,
            rank=self.engine.rank,
            world_size=self.engine.world_size,
        )

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, split: str) -> dict | None:
        """Metrics on rank 0 (None elsewhere); the other ranks wait. The retrieval protocol needs
        every image and caption in one similarity matrix, and every rank holds the whole model."""
        if not self.engine.is_main:
            self.engine.barrier()
            return None
        result = self._evaluate_here(split)
        self.engine.barrier()
        return result

    def _evaluate_here(self, split: str) -> dict:
        stream = EvalStream(self._spec(split, train=False))
        stream.spec.rank, stream.spec.world_size = 0, 1
        loader = make_loader(stream, min(self.config.data.workers, len(stream.spec.urls)))
        return self.recipe.evaluate(self.engine.unwrap(self.model), loader, self.engine.device)

    # ------------------------------------------------------------------ training

    def train_epoch(self, epoch: int) -> float:
        """One epoch of steps; returns the mean training loss."""
        self.train_stream.epoch = epoch
        self.recipe.start_epoch(epoch)
        t = self.config.train
        self.model.train()
        window_start, window_samples, window_steps, window_wait = time.perf_counter(), 0, 0, 0.0
        loss_sum, loss_steps = 0.0, 0
        fetch_start = time.perf_counter()
        for batch in make_loader(self.train_stream, self.config.data.workers):
            window_wait += time.perf_counter() - fetch_start
            self.state.skipped_samples += batch.pop("skipped", 0)
            batch = _to_device(batch, self.engine.device)
            with self.engine.autocast():
                losses = self.recipe.losses(self.model, batch)
            loss = losses["loss"]
            # Every rank holds a share; their sum is the global batch's loss, and checking the sum
            # makes all ranks stop together on a NaN instead of leaving the others hanging.
            losses = {k: global_sum(v) for k, v in losses.items()}
            if not torch.isfinite(losses["loss"]):
                parts = ", ".join(f"{k}={float(v.detach()):.4g}" for k, v in losses.items())
                raise NonFiniteLossError(
                    f"non-finite loss at step {self.state.step + 1} ({parts}). Lower train.lr or set "
                    "train.grad_clip, check the shards for bad features, and restart from the last checkpoint "
                    f"in {self.out_dir / 'checkpoints'} (nothing was saved after it)."
                )
            loss_sum, loss_steps = loss_sum + float(losses["loss"]), loss_steps + 1
            self.engine.backward(loss)
            grad_norm = self.engine.clip_grad_norm(t.grad_clip)
            self.engine.step()
            self.scheduler.step()
            n = _batch_size(batch) * self.engine.world_size
            self.state.step += 1
            self.state.samples_seen += n
            window_samples += n
            window_steps += 1
            if self.engine.is_main and (self.state.step % t.log_every == 0 or self.state.step == self.total_steps):
                elapsed = time.perf_counter() - window_start
                rate = window_samples / max(elapsed, 1e-9)
                eta = (self.total_steps - self.state.step) * elapsed / window_steps
                parts = " ".join(f"{k} {float(v.detach()):.3f}" for k, v in losses.items())
                log.info(
                    "epoch %d step %d/%d | %s | lr %.2e | grad %.2f | %.0f samples/s | data wait %.0f%% | eta %s",
                    epoch + 1, self.state.step, self.total_steps, parts, self.scheduler.get_last_lr()[0],
                    grad_norm, rate, 100 * window_wait / max(elapsed, 1e-9), _hms(eta),
                )
                window_start, window_samples, window_steps, window_wait = time.perf_counter(), 0, 0, 0.0
            if self.state.step >= self.total_steps:
                break
            fetch_start = time.perf_counter()
        self.state.epoch = epoch + 1
        if loss_steps == 0:
            raise RuntimeError(
                f"epoch {epoch + 1} yielded no training batches: every sample of {self.config.data.shards} "
                "was skipped as corrupt or the train split is empty (see the warnings above)"
            )
        return loss_sum / loss_steps

    def fit(self) -> dict:
        cfg = self.config
        results: dict = {"recipe": cfg.recipe, "config": cfg.model_dump(mode="json")}
        start = time.perf_counter()
        if cfg.eval.baseline:
            results["untrained"] = self.evaluate(cfg.eval.split)
            if self.engine.is_main:
                log.info("untrained model on %s: %s", cfg.eval.split, _short(self.recipe.headline(results["untrained"])))
        for epoch in range(self.epochs):
            train_loss = self.train_epoch(epoch)
            self._end_of_epoch(epoch, train_loss)
        results["train_seconds"] = time.perf_counter() - start
        best = self.out_dir / "checkpoints" / "best"
        if self.state.best_epoch is not None and best.is_dir():
            self.engine.unwrap(self.model).load_state_dict(load_model_state(best))
        results["test"] = self.evaluate(cfg.eval.split)
        results.update(
            steps=self.state.step, samples_seen=self.state.samples_seen, skipped_samples=self.state.skipped_samples,
            best_epoch=self.state.best_epoch, history=self.state.history,
            wall_seconds=time.perf_counter() - start,
        )
        if self.state.skipped_samples:
            log.warning("skipped %d corrupt samples during training", self.state.skipped_samples)
        if self.engine.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
        return results

    def _end_of_epoch(self, epoch: int, train_loss: float) -> None:
        cfg, entry = self.config, {"epoch": epoch + 1, "step": self.state.step, "train_loss": train_loss}
        every = cfg.train.validate_every
        if every and ((epoch + 1) % every == 0 or epoch + 1 == self.epochs):
            val = self.evaluate(cfg.data.val_split)
            # Rank 0 decides and shares the decision, so every rank agrees on the best epoch.
            score = float(global_sum(torch.tensor(val["full"]["rsum"] if val else 0.0, dtype=torch.float64)))
            if val:
                entry["val"] = self.recipe.headline(val)
                log.info("epoch %d validation: %s", epoch + 1, _short(entry["val"]))
            if score > self.state.best_score:
                self.state.best_score, self.state.best_epoch = score, epoch + 1
                self.save("best", entry)
        self.state.history.append(entry)
        self.save("last", entry)

    def save(self, name: str, meta: dict) -> None:
        if self.engine.is_main:
            self._save_here(name, meta)
        self.engine.barrier()  # no rank reads or replaces a checkpoint that is still being written

    def _save_here(self, name: str, meta: dict) -> None:
        save_checkpoint(
            self.out_dir / "checkpoints" / name,
            model_state=self.engine.unwrap(self.model).state_dict(),
            train_state={
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "step": self.state.step,
                "epoch": self.state.epoch,
                "samples_seen": self.state.samples_seen,
            },
            config_yaml=to_yaml(self.config),
            vocab=self.recipe.vocab,
            meta={**meta, "recipe": self.config.recipe},
        )


def _batch_size(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _short(metrics: dict) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in metrics.items())
