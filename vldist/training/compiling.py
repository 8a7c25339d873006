"""train.compile: torch.compile for the training step, and the count of recompilations.

- `model`: the recipe's model is compiled in place (`nn.Module.compile`), before the engine wraps
  it: its state_dict keys stay the same (no `_orig_mod.` prefix), so checkpoints of eager and
  compiled runs are interchangeable. What runs compiled is the model's forward, which is what
  `Recipe.training_losses` calls; methods evaluation calls (embed_images, generate) stay eager.
- `step`: `Recipe.training_losses` itself, forward and loss in one compiled function;
  AOTAutograd derives the backward from the same graph. Under DDP (2+ ranks) dynamo compiles
  the wrapped module as its own graphs (its DDPOptimizer), the loss around it.

Shapes: captions are padded to data.max_caption_len (the recipe's `uniform_shapes`, as under
ZeRO-3: one length bucket, because the caption decoders unroll a Python loop over the length;
LAViTeR, whose losses change with padding, opts out: `Recipe.compile_pads_captions`), and with
train.compile_dynamic every other dimension (batch size, the ragged last batch) is symbolic from
the first compilation.

Warm-up and recompilations: the first step that trains a given (streams, updates) combination
and compiles is its warm-up (after a resume, the first such step of the new process; on CUDA with
metrics on, the second step, the first running under the FLOP counter, where dynamo compiles
nothing). Graphs compiled in any later step are recompilations, counted and reported
(metrics.jsonl, Prometheus); a steady run has none.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import nn

from vldist.config import JobConfig
from vldist.errors import ConfigError

log = logging.getLogger("vldist.train")


def check_compile(config: JobConfig, recipe, engine) -> None:
    """Raise ConfigError where train.compile cannot run with this recipe and engine."""
    mode = config.train.compile
    if mode == "none":
        return
    backend = type(engine).__name__
    if getattr(engine, "stage", 0) == 3:
        raise ConfigError(
            f"train.compile={mode} under DeepSpeed ZeRO-3: its hooks gather each module's parameters as it is "
            "called, which compiled graphs do not see. Use ZeRO stage 0-2 (engine.deepspeed_config) or "
            "train.compile=none"
        )
    if mode == "step" and backend == "DeepSpeedEngine":
        raise ConfigError(
            "train.compile=step traces the recipe's losses through the engine's wrapper, and DeepSpeed's engine "
            "(engine.backend=deepspeed) runs its own hooks in its forward. Use train.compile=model, which compiles "
            "the model under DeepSpeed's wrapper, or engine.backend=accelerate"
        )
    if backend == "FSDPEngine":
        raise ConfigError(
            f"train.compile={mode} under engine.backend=fsdp is not supported yet: compiling the whole module traces "
            "FSDP2's gather and reduce-scatter hooks, where dynamo breaks the graph and runs the module eager, and "
            "compiling each sharded unit's forward stalled in dynamo's tracing of VSRN's units on 2 gloo ranks "
            "(torch 2.14, measured). Use train.compile=none, or engine.backend=accelerate to compile"
        )
    if config.train.compile_mode != "default" and config.train.compile_backend != "inductor":
        raise ConfigError(
            f"train.compile_mode={config.train.compile_mode} is a mode of the inductor backend, and "
            f"train.compile_backend={config.train.compile_backend}. Use train.compile_backend=inductor or "
            "train.compile_mode=default"
        )
    if mode == "step" and not recipe.compile_step:
        raise ConfigError(
            f"train.compile=step: recipe '{recipe.name}' does not allow its losses to be compiled "
            f"({recipe.compile_step_refusal}). Use train.compile=model, which compiles its model only"
        )


class StepCompiler:
    """What train.compile changes in the trainer: the recipe's shapes, the model, the losses'
    function, and the watch over compilations."""

    def __init__(self, config: JobConfig, recipe, engine):
        t = config.train
        check_compile(config, recipe, engine)
        self.mode, self.recipe = t.compile, recipe
        self.options = {"backend": t.compile_backend, "dynamic": True if t.compile_dynamic else None}
        if t.compile_mode != "default":
            self.options["mode"] = t.compile_mode
        # inductor's modes that replay graphs as CUDA graphs
        self.cuda_graphs = self.enabled and t.compile_mode in ("reduce-overhead", "max-autotune")
        self.recompilations = 0  # graphs compiled after warm-up, this process
        self._seen: set[tuple] = set()
        self._losses = recipe.training_losses
        if self.mode == "none":
            return
        # As a fresh process would: graphs of an earlier run here (a previous stage of the job)
        # count against dynamo's cache_size_limit, past which it runs eager without a word.
        torch._dynamo.reset()
        if recipe.compile_pads_captions:
            recipe.uniform_shapes = True  # captions padded to data.max_caption_len: one length to compile for
        if self.mode == "step":
            self._losses = torch.compile(recipe.training_losses, **self.options)
        log.info(
            "train.compile=%s (backend %s, mode %s, dynamic shapes %s): %s",
            self.mode,
            t.compile_backend,
            t.compile_mode,
            "on" if t.compile_dynamic else "off",
            f"captions padded to data.max_caption_len={config.data.max_caption_len}"
            if recipe.uniform_shapes
            else "captions of each batch's own length",
        )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def compile_model(self, model: nn.Module) -> nn.Module:
        """`model`: the module compiled in place (same module, same state_dict keys)."""
        if self.mode == "model":
            model.compile(**self.options)
        return model

    def training_losses(self, model: nn.Module, batch: dict, update: str) -> dict[str, torch.Tensor]:
        return self._losses(model, batch, update)

    @contextlib.contextmanager
    def watch(self, key: tuple):
        """Around one optimizer step; `key`: what it trains (its streams and updates). Graphs
        compiled in the first step of a key that compiles are its warm-up; any later are
        recompilations. (On CUDA the FLOP counter's first step runs eager: dynamo does not
        compile under a dispatch mode, so the second step warms up.)"""
        if not self.enabled:
            yield
            return
        if self.cuda_graphs:  # a new step may overwrite the last step's graph outputs (all read by now)
            torch.compiler.cudagraph_mark_step_begin()
        before, breaks, start = compiled_graphs(), graph_breaks(), time.perf_counter()
        yield
        new = compiled_graphs() - before
        if key not in self._seen:
            if new:  # a first step that compiled nothing (run under the FLOP counter: eager) is not its warm-up
                self._seen.add(key)
                log.info(
                    "train.compile=%s: warm-up of %s compiled %d graphs (%d graph breaks) in %.1f s",
                    self.mode,
                    "/".join(map(str, key)),
                    new,
                    graph_breaks() - breaks,
                    time.perf_counter() - start,
                )
        elif new:
            self.recompilations += new
            log.warning(
                "train.compile=%s: %d graphs recompiled after warm-up (%d in all): a shape or a guard changed; "
                "TORCH_LOGS=recompiles says which",
                self.mode,
                new,
                self.recompilations,
            )


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (a frame with graph breaks makes several)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
