"""Model and optimizer state as a torch.distributed.checkpoint (DCP) directory: every rank writes
its part, nothing is gathered on rank 0, and the directory loads on any number of ranks.

Under DDP every rank holds the whole model and optimizer; DCP's planner deduplicates the replicated
tensors and spreads their writes over the ranks (one file per rank). The state is keyed by
parameter name (`torch.distributed.checkpoint.state_dict`), not by an optimizer's parameter
index, which is what lets DCP re-cut it for another world size.

Safety: DCP's default loader unpickles the non-tensor values it stores (the optimizer's
param_groups) with torch.load(weights_only=False); vldist's planner loads them weights_only.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp_module

SHARDED_DIR = "sharded"  # inside a checkpoint directory
MODEL_KEY = "model"
EXTRA_KEY = "engine"


def _dcp() -> dcp_module:
    """torch.distributed.checkpoint, imported on first use: it adds about 0.6 s to the start of
    every process that imports it (`python -X importtime`), and most runs write plain checkpoints."""
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _weights_only_planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyLoadPlanner


def _weights_only_planner():
    return _weights_only_planner_class()()


def _tensor_entries(directory: Path) -> dict:
    """DCP's metadata of the model's tensors in `directory`, by their saved key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _dcp().FileSystemReader(str(directory)).read_metadata()
    prefix = MODEL_KEY + "."
    return {
        key: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns on every call without a process group that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def state_of(model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """The model and every named optimizer, keyed by parameter name (a fresh optimizer's state is
    made first, with a zero step at lr 0, so that a template to load into has every key)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(ignore_frozen_params=False)
    return {
        MODEL_KEY: get_model_state_dict(model, options=options),
        "optimizers": {name: get_optimizer_state_dict(model, opt, options=options) for name, opt in optimizers.items()},
    }


def save(
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    directory: Path,
    asynchronous: bool = False,
    process_group=None,
    extra: dict | None = None,
) -> Future | None:
    """Collective. Write the state into `directory` (each rank its part). Asynchronous: the state is
    copied to CPU memory now and written by a background thread; the returned future completes
    when every rank's files and the metadata are written. `process_group`: the group DCP's own
    collectives use, which for an asynchronous save must not be the one training uses (they would
    interleave with the training step's collectives). `extra`: small state of the engine's own
    (the loss scaler's), saved beside."""
    state = {**state_of(model, optimizers), EXTRA_KEY: extra or {}}
    no_dist = not _distributed()
    with _one_process_is_meant():
        if asynchronous:
            return _dcp().async_save(state, checkpoint_id=str(directory), process_group=process_group, no_dist=no_dist)
        _dcp().save(state, checkpoint_id=str(directory), process_group=process_group, no_dist=no_dist)
    return None


def load(
    model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], directory: Path, extra: dict | None = None
) -> dict:
    """Collective. Load the state saved by `save`, on any number of ranks; returns the `extra`
    state, loaded into the template given (its keys say what to read)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = {**state_of(model, optimizers), EXTRA_KEY: extra or {}}
    with _one_process_is_meant():
        _dcp().load(state, checkpoint_id=str(directory), planner=_weights_only_planner(), no_dist=not _distributed())
    set_model_state_dict(model, state[MODEL_KEY])
    for name, optimizer in optimizers.items():
        set_optimizer_state_dict(model, optimizer, state["optimizers"][name])
    return state[EXTRA_KEY]


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes, from DCP's metadata alone."""
    prefix = MODEL_KEY + "."
    return {key[len(prefix) :]: tuple(md.size) for key, md in _tensor_entries(directory).items()}


def read_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from `directory`, in this process alone (no process group): what
    evaluation and export read from a checkpoint that has no model.safetensors."""
    prefix = MODEL_KEY + "."
    template = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in _tensor_entries(directory).items()}
    with _one_process_is_meant():
        _dcp().load(template, checkpoint_id=str(directory), planner=_weights_only_planner(), no_dist=True)
    return {key[len(prefix) :]: value for key, value in template.items()}
