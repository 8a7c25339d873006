"""Engines by name: `engine.backend` picks one; each takes the job config and reads its
launcher's environment itself (vldist/distributed/engine.py has the interface)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vldist.distributed.engine import Engine

# name -> "module:Class", imported when chosen (DeepSpeed's import is slow and optional)
ENGINES = {
    "accelerate": "vldist.distributed.accelerate_engine:AccelerateEngine",
    "deepspeed": "vldist.distributed.deepspeed_engine:DeepSpeedEngine",
    "fsdp": "vldist.distributed.fsdp_engine:FSDPEngine",
}


def engine_class(backend: str) -> type[Engine]:
    if backend not in ENGINES:
        raise ValueError(f"unknown engine backend '{backend}'; backends: {', '.join(ENGINES)}")
    module, _, attr = ENGINES[backend].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(config) -> Engine:
    """The engine of `config.engine.backend`, built from the job config."""
    return engine_class(config.engine.backend)(config)
