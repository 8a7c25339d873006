"""train.activation_checkpointing: the recipe's heavy blocks keep no activations for the backward,
which recomputes them (torch.utils.checkpoint, non-reentrant).

A recipe names its blocks (`Recipe.checkpointed_blocks`); `checkpoint_blocks` gives each block,
on the instance, a `forward` that calls its class's forward under `torch.utils.checkpoint` while
the block trains with gradient enabled, and plainly otherwise (evaluation, generation, frozen
modules in eval mode, forwards under no_grad). No module is wrapped or moved, so parameter names
and state_dict keys stay the same (torch's CheckpointWrapper would add
`_checkpoint_wrapped_module.`): checkpoints of runs with and without it are interchangeable.

- Random state: checkpoint's default preserve_rng_state replays the forward's dropout masks and
  draws (LAViTeR's conditioning noise) in the recompute, so the gradients are those of the forward.
- BatchNorm: the recompute runs the block's batch norms again, which normalise with the same batch
  statistics and would move their running statistics a second time: they are put back as they
  were before the recompute, so a step moves them once, as without checkpointing.
- torch.compile: dynamo traces the checkpoint as a higher-order op and AOTAutograd recomputes the
  region inside the backward graph, where buffer updates are not repeated: the compiled call
  passes no recompute context.
- DDP: the non-reentrant form keeps the autograd graph whole, so DDP's hooks (and its search for
  unused parameters) see every parameter as without it. DeepSpeed ZeRO-3 is refused: it gathers
  a module's parameters in hooks around its call, which the recompute of a block's own forward
  does not pass through.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from functools import partial
from types import MethodType

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vldist.errors import ConfigError

log = logging.getLogger("vldist.train")


def check_activation_checkpointing(recipe, engine) -> None:
    """Raise ConfigError where train.activation_checkpointing cannot run with this engine."""
    if getattr(engine, "stage", 0) == 3:
        raise ConfigError(
            "train.activation_checkpointing under DeepSpeed ZeRO-3: ZeRO-3 gathers each module's parameters in "
            "hooks around its call, and the backward's recompute of a checkpointed block does not pass through "
            "them. Use ZeRO stage 0-2 (engine.deepspeed_config) or train.activation_checkpointing=false"
        )


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """Checkpoint each of `blocks` (submodules of `model`) in place; returns their names."""
    names = {id(module): name for name, module in model.named_modules()}
    for block in blocks:
        if id(block) not in names:
            raise ValueError(
                f"{type(block).__name__} is not a submodule of the model: only its own blocks can be checkpointed"
            )
        block.forward = MethodType(_checkpointed_forward, block)
    return [names[id(block)] for block in blocks]


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _checkpointed_forward


def apply_activation_checkpointing(model: nn.Module, recipe, engine) -> None:
    """The trainer's call, on the built model before the engine wraps it (and before compile)."""
    check_activation_checkpointing(recipe, engine)
    blocks = recipe.checkpointed_blocks(model)
    if not blocks:
        raise ConfigError(
            f"train.activation_checkpointing: recipe '{recipe.name}' names no blocks to checkpoint "
            "(Recipe.checkpointed_blocks, docs/adding-a-method.md). Set train.activation_checkpointing=false"
        )
    names = checkpoint_blocks(model, blocks)
    log.info("train.activation_checkpointing: %d blocks recomputed in the backward: %s", len(names), ", ".join(names))


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward
    if not (self.training and torch.is_grad_enabled()):
        return forward(self, *args, **kwargs)
    if torch.compiler.is_compiling():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return checkpoint(
        forward, self, *args, use_reentrant=False, context_fn=partial(_recompute_contexts, self), **kwargs
    )


def _recompute_contexts(block: nn.Module):
    """(around the forward, around the recompute) for torch.utils.checkpoint's context_fn."""
    return nullcontext(), _running_statistics_untouched(block)


@contextmanager
def _running_statistics_untouched(block: nn.Module):
    """The block's batch norms' running statistics as they were before the recompute. (Turning
    their tracking off instead would save other tensors than the forward did, which checkpoint
    refuses.)"""
    kept = [
        (buffer, buffer.clone())
        for m in block.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in kept:
                buffer.copy_(before)
