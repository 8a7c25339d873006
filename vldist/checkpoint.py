"""Atomic checkpoints: written to a temporary directory, marked complete, then renamed into place.

Layout of one checkpoint directory:
    model.safetensors   model weights (what `vldist.evaluate` and exports need)
    state.pt            optimizer, scheduler, RNG states, counters (loaded with weights_only=True)
    config.yaml         the job config that produced it
    vocab.json          the vocabulary the model's embeddings index
    meta.json           step, epoch, metrics
    COMPLETE            written last: a directory without it is never loaded
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message says which and what to do."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, *, model_state: dict, train_state: dict, config_yaml: str, vocab, meta: dict) -> Path:
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, tmp / "model.safetensors")
    torch.save(train_state, tmp / "state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    vocab.save(tmp / "vocab.json")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / MARKER).write_text("ok\n")
    _fsync_dir(tmp)
    if directory.exists():  # replace an older checkpoint of the same name
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    _fsync_dir(directory.parent)
    return directory


def is_complete(directory: Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def load_model_state(directory: Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    _require_complete(directory)
    try:
        return load_file(directory / "model.safetensors")
    except Exception as err:  # noqa: BLE001 - safetensors raises several types on damage
        raise CheckpointError(f"cannot read {directory / 'model.safetensors'} ({err}); the checkpoint is damaged") from err


def load_train_state(directory: Path) -> dict:
    directory = Path(directory)
    _require_complete(directory)
    try:
        return torch.load(directory / "state.pt", weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"cannot read {directory / 'state.pt'} ({err}); the checkpoint is damaged") from err


def _require_complete(directory: Path) -> None:
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at '{directory}'")
    if not is_complete(directory):
        raise CheckpointError(
            f"checkpoint '{directory}' is incomplete (no {MARKER} marker: the run stopped while writing it); "
            "use an earlier checkpoint"
        )


STEP_PREFIX = "step-"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_checkpoints(directory: Path) -> list[Path]:
    """Complete step-numbered checkpoints in `directory`, oldest first."""
    found = [p for p in Path(directory).glob(f"{STEP_PREFIX}*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete step checkpoints, and the temporary
    directories of saves that a killed process left behind."""
    for old in step_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in Path(directory).glob(".*.tmp-*"):
        if not leftover.name.endswith(f".tmp-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory: its best checkpoint, else its newest complete one."""
    path = Path(path)
    if is_complete(path):
        return path
    ckpts = path / "checkpoints"
    if (ckpts / "best").is_dir() and is_complete(ckpts / "best"):
        return ckpts / "best"
    complete = step_checkpoints(ckpts)
    if complete:
        return complete[-1]
    if path.is_dir() and not ckpts.is_dir():
        _require_complete(path)  # raises with the precise reason
    raise CheckpointError(f"no complete checkpoint under '{path}'")
