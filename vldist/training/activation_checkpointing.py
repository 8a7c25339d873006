"""train.activation_checkpointing: the recipe's heavy blocks keep no activations for the backward,
which recomputes them (torch.utils.checkpoint, non-reentrant).

A recipe names its blocks (`Recipe.checkpointed_blocks`); `checkpoint_blocks` gives each block,
on the instance, a `forward` that calls its class's forward under `torch.utils.checkpoint` while
the block trains with gradient enabled, and plainly otherwise (evaluation, generation, frozen
modules in eval mode, forwards under no_grad). A block whose forward unrolls a loop over time
steps may declare `checkpoint_steps` (VSRN's attention decoder): it is then told to checkpoint
each step (models/common.py's checkpointed_step) rather than checkpointed whole, because a whole
unroll is recomputed whole in the backward, all its steps' activations alive at once again. No module is wrapped or moved, so parameter names
and state_dict keys stay the same (torch's CheckpointWrapper would add
`_checkpoint_wrapped_module.`): checkpoints of runs with and without it are interchangeable.

- Random state: checkpoint's default preserve_rng_state replays the forward's dropout masks and
  draws (LAViTeR's conditioning noise) in the recompute, so the gradients are those of the forward.
- BatchNorm: the recompute runs the block's batch norms again, which normalise with the same batch
  statistics and would move their running statistics a second time: hooks on them put the
  statistics back as they were before a call made during the backward, so a step moves them
  once, as without checkpointing. (Hooks rather than checkpoint's recompute context: under
  torch.compile a block whose body dynamo cannot trace whole, VSRN's masked batch norm, runs its
  checkpoint eagerly from the compiled frame, without any context the compiled call would pass.)
- torch.compile: dynamo traces the checkpoint as a higher-order op and AOTAutograd recomputes the
  region inside the backward graph, where buffer updates are not repeated.
- DDP: the non-reentrant form keeps the autograd graph whole, so DDP's hooks (and its search for
  unused parameters) see every parameter as without it. DeepSpeed ZeRO-3 is refused: it gathers
  a module's parameters in hooks around its call, which the recompute of a block's own forward
  does not pass through.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vldist.errors import ConfigError

log = logging.getLogger("vldist.train")


def check_activation_checkpointing(recipe, engine) -> None:
    """Raise ConfigError where train.activation_checkpointing cannot run with this engine or compile mode."""
    compile_mode = recipe.config.train.compile
    if compile_mode != "none" and not recipe.checkpoint_compiles:
        raise ConfigError(
            f"train.activation_checkpointing with train.compile={compile_mode}: recipe '{recipe.name}' refuses the "
            f"combination ({recipe.checkpoint_compile_refusal}). Use one of the two"
        )
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
        if hasattr(type(block), "checkpoint_steps"):  # a loop that checkpoints each of its steps
            block.checkpoint_steps = True
        else:
            block.forward = MethodType(_checkpointed_forward, block)
        _keep_statistics_on_recompute(block)
    return [names[id(block)] for block in blocks]


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _checkpointed_forward or getattr(module, "checkpoint_steps", False)


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
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def _keep_statistics_on_recompute(block: nn.Module) -> None:
    """Hooks on the block's batch norms: a call during a backward (the recompute) leaves their
    running statistics as they were before it."""
    for module in block.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, _HOOKED, False):
            setattr(module, _HOOKED, True)
            module.register_forward_pre_hook(_before_batch_norm)
            # always_call: checkpoint ends a recompute early by raising once the last tensor it
            # needs is saved, which may be inside the batch norm, after its statistics moved
            module.register_forward_hook(_after_batch_norm, always_call=True)


_HOOKED = "_statistics_kept_on_recompute"


def _recomputing() -> bool:
    # Compiled regions are recomputed by AOTAutograd in the backward graph, without these hooks.
    # Eagerly, a forward inside a backward graph task is checkpoint's recompute (its unpack hook
    # runs there); torch.utils.checkpoint asks the same of the engine.
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _before_batch_norm(module: nn.modules.batchnorm._BatchNorm, args) -> None:
    if module.training and module.track_running_stats and _recomputing():
        module._statistics_before_recompute = [b.clone() if b is not None else None for b in _statistics(module)]


def _after_batch_norm(module: nn.modules.batchnorm._BatchNorm, args, output) -> None:
    kept = module.__dict__.pop("_statistics_before_recompute", None)
    if kept is None:
        return
    with torch.no_grad():
        for buffer, before in zip(_statistics(module), kept, strict=True):
            if buffer is not None:
                buffer.copy_(before)


def _statistics(module: nn.modules.batchnorm._BatchNorm) -> tuple:
    return module.running_mean, module.running_var, module.num_batches_tracked
