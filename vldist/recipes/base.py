"""What a recipe is: one paper method, as the trainer sees it.

The contract has three parts: data (the streams it trains on, a sample from a raw tar sample,
batches), training (the model, its starting weights, optimizers, updates, losses) and evaluation
(metrics over a split, the selection score, the report). Optional capabilities are Protocols
(recipes/capabilities.py). A recipe reads no files or checkpoints, opens no shard sets and
touches no process group: each rank's run and the trainer hand it what it needs (its vocabulary, the
job's shard sets, the weights it starts from) and the engine runs what it builds.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Required, TypedDict, final

import torch
from torch import nn

from vldist.config import JobConfig, Section
from vldist.data.shardset import ShardSet
from vldist.data.streams import StreamSource
from vldist.data.vocab import Vocab


@dataclass(frozen=True)
class StartingWeights:
    """The checkpoint a run starts from (`Recipe.starts_from`), as each rank read it (training/on_each_rank.py)."""

    path: Path  # the checkpoint directory
    recipe: str | None  # the recipe that wrote it
    config: dict  # its config.yaml, upgraded to today's keys
    vocab: list[str]  # its vocabulary's words
    state: dict[str, torch.Tensor] = field(repr=False)  # its weights


class Evaluation(TypedDict, total=False):
    """What `Recipe.evaluate` returns: the counts the platform prints and records, beside the
    recipe's own metrics under keys of its choosing (nested as it likes; metrics.json keeps them
    whole). vldist.recipes.contract checks every evaluation against it."""

    n_images: Required[int]  # images evaluated (or pairs: set `unit`)
    n_captions: Required[int]  # captions evaluated
    unit: str  # what n_images counts when not images ("pairs")
    examples: list[dict]  # generated captions, for the trackers' tables
    images: dict  # name -> PIL image: written as PNG under the run's images/ and replaced by its path


class Recipe(ABC):
    name: ClassVar[str]  # the registry key it is found by (vldist.recipes.get_recipe sets it)
    description: ClassVar[str]
    ModelConfig: ClassVar[type[Section]]

    def __init__(self, config: JobConfig, vocab: Vocab, feature_dim: int | None = None, uniform_shapes: bool = False):
        """uniform_shapes: every rank's batches must have the same shapes (under ZeRO-3 the
        engine fetches parameters with one collective per module call, so ranks must make the
        same calls): pad to the configured lengths, not to the batch's longest."""
        self.config = config
        self.vocab = vocab
        self.feature_dim = feature_dim
        self.uniform_shapes = uniform_shapes

    # ================================================================== data

    sample_keys: ClassVar[tuple[str, ...]]  # tar members the recipe reads, e.g. ("json", "regions.npy")
    optional_keys: ClassVar[tuple[str, ...]] = ()  # members read when a sample has them (L2C: masks)

    @classmethod
    def train_streams(cls, config: JobConfig) -> dict[str, str | StreamSource]:
        """Named training streams and the split (or StreamSource) each reads. Several take turns,
        one optimizer step each (L2C: image pairs and single-image captions); each batch carries
        its stream's name as batch['stream']. A class method: each rank opens the shard sets it
        names before the recipe exists (their captions make its vocabulary)."""
        return {"main": config.data.train_split}

    def stream_functions(self, stream: str) -> tuple[Callable, Callable]:
        """(sample_fn, collate_fn) that turn a stream's raw samples into its batches."""
        return self.train_sample, self.collate_train

    @abstractmethod
    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        """A decoded training sample from a raw tar sample; raise on corrupt input."""

    @abstractmethod
    def eval_sample(self, raw: dict, rng: random.Random) -> dict: ...

    @abstractmethod
    def collate_train(self, samples: list[dict]) -> dict: ...

    @abstractmethod
    def collate_eval(self, samples: list[dict]) -> dict: ...

    # ================================================================== training

    # Some updates leave parameters without gradient (alternating optimizers, training phases):
    # DDP must then look for unused parameters after each backward.
    dynamic_graph: ClassVar[bool] = False
    # train.compile=step compiles `training_losses` whole (training/compiling.py). A recipe whose
    # losses cannot be compiled so sets compile_step False and says why in compile_step_refusal;
    # train.compile=model (the model's forward only) then remains.
    compile_step: ClassVar[bool] = True
    compile_step_refusal: ClassVar[str] = ""
    # Compiled runs pad captions to data.max_caption_len (uniform_shapes, one length to compile
    # for). A recipe whose losses change with that padding sets this False: its batches keep
    # their own lengths, marked dynamic instead.
    compile_pads_captions: ClassVar[bool] = True
    # train.accumulate_negatives needs recipes/capabilities.py's CachesNegatives; a recipe without
    # it says here why its objective does not split so.
    accumulate_negatives_refusal: ClassVar[str] = (
        "it does not split its loss into a cross-batch term over cached embeddings and terms of each micro-batch "
        "(recipes/capabilities.py, CachesNegatives)"
    )

    @classmethod
    def stages(cls, config: JobConfig) -> list[tuple[str, JobConfig]]:
        """The runs one `python -m vldist.train` of this job makes, in order, as (name, config).
        Most recipes train once; a method that starts from another's model (CL from an MLE
        captioner) returns that run first. Each run has its own output dir and resumes alone."""
        return [(config.recipe, config)]

    @abstractmethod
    def build_model(self) -> nn.Module: ...

    # train.activation_checkpointing with train.compile: a recipe whose checkpointed blocks dynamo
    # cannot compile sets this False and says why; the combination is then refused.
    checkpoint_compiles: ClassVar[bool] = True
    checkpoint_compile_refusal: ClassVar[str] = ""

    def checkpointed_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The submodules of `model` (as build_model made it) that train.activation_checkpointing
        recomputes in the backward instead of keeping their activations: the heavy ones (reasoning
        layers, decoders, transformer layers). Each block's forward is checkpointed whole
        (training/activation_checkpointing.py). Default: none, and the option is refused."""
        return []

    def starts_from(self) -> str | None:
        """A checkpoint or run directory whose weights this run starts from (CL: its captioner;
        LAViTeR: the phase before), or None. Each rank reads it and hands it to `initialize`."""
        return None

    def initialize(self, model: nn.Module, start: StartingWeights | None, shards) -> None:
        """Starting weights and fitted parts, for training only (never when a checkpoint is
        evaluated or captioned, which brings its own): CL's target and reference from `start`,
        the two-branch tf-idf from the captions of `shards` (the job's JobShards). Called by the
        trainer on the freshly built model, before the engine wraps it."""
        return None  # an optional hook: nothing to do unless a recipe needs it

    def optimizer_groups(self, model: nn.Module) -> dict[str, list]:
        """Named optimizers and their parameters (or torch param-group dicts with their own lr).
        Default: one optimizer, 'main', over every trainable parameter. Frozen parameters
        (requires_grad=False, e.g. a reference model) are in none: never updated, and saved once,
        in the checkpoint's weights."""
        return {"main": [p for p in model.parameters() if p.requires_grad]}

    def start_epoch(self, epoch: int) -> None:
        """Called by the trainer before each epoch (0-based): for schedules and training phases."""
        return None  # an optional hook: nothing to do unless a recipe needs it

    def start_step(self, step: int) -> None:
        """Called by the trainer before each optimizer step: for what the step's losses draw from
        it (CL and the similarity network seed their negatives with it)."""
        return None  # an optional hook: nothing to do unless a recipe needs it

    def updates(self, step: int) -> tuple[str, ...]:
        """The optimizers stepped at optimizer step `step`, in order; no side effects. Each gets
        its own forward and backward on the same batch: a GAN alternates ('discriminator',
        'generator'); a phase that trains one part returns only its optimizer."""
        return ("main",)

    @abstractmethod
    def forward_inputs(self, batch: dict, update: str = "main") -> dict[str, Any]:
        """The keyword arguments of the model's forward for one micro-batch and optimizer `update`.
        The trainer calls the engine's wrapper of the model with them (training_losses): that call
        is where the ranks' gradients get synchronised, so a recipe never calls its forward itself."""

    @abstractmethod
    def losses(
        self, outputs: Any, batch: dict, update: str = "main", model: nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """From the forward's `outputs`: {'loss': this rank's share of the loss for optimizer
        `update`, <component>: detached parts for logging}. `model` is the module itself (not the
        engine's wrapper), for what a loss computes from the outputs with the model's own layers
        (the similarity network's fusion layers on pairs drawn from the global batch): the forward
        having gone through the engine, gradients through those layers are synchronised too."""

    @final
    def training_losses(self, model: nn.Module, batch: dict, update: str = "main") -> dict[str, torch.Tensor]:
        """One micro-batch's losses as the trainer computes them: `model` (the engine's wrapper)
        called on forward_inputs, its outputs handed to losses. Not for overriding: a recipe that
        reached the model past the engine's wrapper would train each rank apart (the replica check
        stops such a run; tests/fixtures/meanpool_plugin's negative example does it on purpose)."""
        outputs = model(**self.forward_inputs(batch, update))
        return self.losses(outputs, batch, update, model=unwrap(model))

    # ================================================================== evaluation

    images_per_caption: ClassVar[int] = 1  # images one caption describes (L2C: a pair), for vldist.caption

    def preflight(self, shards: ShardSet) -> None:
        """Checks before any training or evaluation starts, so that a missing tool or a shard
        set without what the recipe reads fails at once rather than after hours (captioning:
        Java for pycocoevalcap; phrase localisation: proposals in the set)."""
        return None  # an optional hook: nothing to do unless a recipe needs it

    @abstractmethod
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> Evaluation:
        """Metrics over a whole eval split, with the counts of Evaluation. `validation`: the
        per-epoch check that picks the best checkpoint, where a recipe may leave out costly
        metrics that selection does not use."""

    # headline and report read only the metrics: class methods, so that a results table needs no
    # model or vocabulary (vldist.train and vldist.evaluate call them on the class).

    @classmethod
    def headline(cls, metrics: Evaluation) -> dict[str, float]:
        """The few numbers of the progress lines and the results table, flat. Default: every number
        in the metrics but the counts, nested keys joined with '/'."""
        return {key: value for key, value in _numbers(metrics) if key not in ("n_images", "n_captions")}

    @abstractmethod
    def selection_score(self, metrics: Evaluation) -> float:
        """The validation number that picks the best checkpoint, higher is better (VSRN: rsum;
        captioning: CIDEr-D)."""

    @classmethod
    @abstractmethod
    def report(cls, rows: dict[str, Evaluation], split: str) -> str:
        """The results table printed after training and by `vldist.evaluate`: `rows` maps a name
        ('untrained', 'trained') to that model's whole metrics on `split`; the last is the one
        that matters (it may add what the table leaves out: skipped samples, example outputs)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module under the engine's wrapper (DistributedDataParallel's, DeepSpeed's), or `model`."""
    return getattr(model, "module", model)


def _numbers(metrics: dict, prefix: str = ""):
    """(key, value) of every number in nested metrics, keys joined with '/'."""
    for key, value in metrics.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value
