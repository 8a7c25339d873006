"""Atomic checkpoints: written to a temporary directory, marked complete, then renamed into place.

Layout of one checkpoint directory:
    model.safetensors   the whole model's weights (what `vldist.evaluate` and exports read); under
                        train.checkpoint_format=sharded only in the best and final checkpoints
    sharded/            train.checkpoint_format=sharded: model and optimizers, torch.distributed.checkpoint
                        files (one per rank) and its .metadata
    state.pt            LR schedulers, every rank's RNG state, run counters (loaded weights_only=True)
    optimizer.pt        optimizer state (Accelerate engine, plain format), or
    deepspeed/          DeepSpeed's sharded model and optimizer state, one file per rank (ZeRO)
    config.yaml         the job config that produced it
    vocab.json          the vocabulary the model's embeddings index
    meta.json           step, epoch, metrics; `final` on the last step of a run
    files.json          size and sha256 of every file above: a damaged file is found before loading
    COMPLETE            written last: a directory without it is never loaded

Several ranks may write into one checkpoint (DeepSpeed): rank 0 calls `begin`, every rank writes
its files into the temporary directory, and rank 0 calls `commit` once all are done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from vldist.checkpoint import sharded_state, upgrades
from vldist.checkpoint.sharded_state import SHARDED_DIR
from vldist.errors import CheckpointError, CheckpointWriteError, IncompatibleCheckpoint
from vldist.file_integrity import sha256_file

MARKER = "COMPLETE"
FILES = "files.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(directory: Path) -> Path:
    """Where `directory` is written before it is committed; the same name on every rank."""
    directory = Path(directory)
    return directory.with_name(f".{directory.name}.tmp")


def begin(directory: Path) -> Path:
    """A fresh, empty temporary directory for `directory` (any leftover of a killed save removed)."""
    tmp = temporary_path(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_files(
    tmp: Path, *, model_state: dict | None, train_state: dict | None, config_yaml: str, vocab, meta: dict
) -> None:
    """The checkpoint's own files (model_state None: the weights are in the sharded state; train_state
    None: a model alone, as vldist.export writes)."""
    if model_state is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, tmp / "model.safetensors")
    if train_state is not None:
        torch.save(train_state, tmp / "state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    vocab.save(tmp / "vocab.json")
    (tmp / "meta.json").write_text(json.dumps(upgrades.stamp(meta), indent=2) + "\n")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (MARKER, FILES))


def commit(tmp: Path, directory: Path) -> Path:
    """Record, flush and mark `tmp` complete, then rename it to `directory` (replacing an older one)."""
    directory = Path(directory)
    listing = {}
    for f in _files(tmp):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        listing[str(f.relative_to(tmp))] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    (tmp / FILES).write_text(json.dumps(listing, indent=1) + "\n")
    (tmp / MARKER).write_text("ok\n")
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        _fsync_dir(d)
    if directory.exists():  # replace an older checkpoint of the same name
        old = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    _fsync_dir(directory.parent)
    return directory


def save_checkpoint(directory: Path, **contents) -> Path:
    """begin + write_files + commit, for a single writer."""
    tmp = begin(directory)
    write_files(tmp, **contents)
    return commit(tmp, directory)


def verify(directory: Path) -> None:
    """Raise CheckpointError unless `directory` is complete and every file has its recorded size
    and checksum. Every rank can run it and reach the same verdict before any collective load."""
    directory = Path(directory)
    _require_complete(directory)
    try:
        listing = json.loads((directory / FILES).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {directory / FILES} ({err}); the checkpoint is damaged") from err
    for name, expected in listing.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; the checkpoint is damaged")
        if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
            raise CheckpointError(
                f"{path} has {path.stat().st_size} bytes, not the {expected['bytes']} written, or another checksum; "
                "the checkpoint is damaged"
            )


def is_complete(directory: Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def _weights_in_shards(directory: Path) -> bool:
    """A periodic checkpoint of train.checkpoint_format=sharded: no model.safetensors, the weights
    are in DCP's files."""
    return not (directory / "model.safetensors").is_file() and (directory / SHARDED_DIR).is_dir()


def load_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The weights, under today's parameter names (a checkpoint of an older vldist is upgraded)."""
    directory = Path(directory)
    _require_complete(directory)
    if _weights_in_shards(directory):
        try:
            state = sharded_state.read_model_state(directory / SHARDED_DIR)
        except Exception as err:  # noqa: BLE001 - DCP raises several types on damage
            raise CheckpointError(
                f"cannot read the weights in {directory / SHARDED_DIR} ({err}); the checkpoint is damaged"
            ) from err
        return upgrades.upgrade_state(state, read_meta(directory))
    try:
        state = load_file(directory / "model.safetensors")
    except Exception as err:  # noqa: BLE001 - safetensors raises several types on damage
        raise CheckpointError(
            f"cannot read {directory / 'model.safetensors'} ({err}); the checkpoint is damaged"
        ) from err
    return upgrades.upgrade_state(state, read_meta(directory))


def read_meta(directory: Path) -> dict:
    try:
        return json.loads((Path(directory) / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"cannot read {Path(directory) / 'meta.json'} ({err}); the checkpoint is damaged"
        ) from err


def read_config(directory: Path) -> dict:
    """The job config the checkpoint was written with, as a dict, with keys moved since upgraded."""
    path = Path(directory) / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"cannot read {path} ({err}); the checkpoint is damaged") from err
    return upgrades.upgrade_config(raw, read_meta(directory))


def load_train_state(directory: Path) -> dict:
    directory = Path(directory)
    _require_complete(directory)
    return load_torch_file(directory / "state.pt")


def load_torch_file(path: Path):
    """torch.load with weights_only=True, any failure reported as a damaged checkpoint."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - torch raises several types on damage
        raise CheckpointError(f"cannot read {path} ({err}); the checkpoint is damaged") from err


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


CHOICES = "best, latest or step-N"


def chosen_name(which: str, best: bool, steps: list[str]) -> str | None:
    """The checkpoint name `which` (best, latest or step-N) picks among a run's complete ones (`best`:
    whether there is a best; `steps`: the step checkpoints' names, oldest first); None when it
    names none of them. Raises CheckpointError when `which` is none of the three forms."""
    if which == "latest":
        return steps[-1] if steps else None
    if which == "best":
        return "best" if best else None
    if which.startswith(STEP_PREFIX) and which[len(STEP_PREFIX) :].isdigit():
        name = step_name(int(which[len(STEP_PREFIX) :]))
        return name if name in steps else None
    raise CheckpointError(f"--checkpoint {which}: not one of {CHOICES} (step-12 or step-00000012)")


def step_checkpoints(directory: Path) -> list[Path]:
    """Complete step-numbered checkpoints in `directory`, oldest first."""
    found = [p for p in Path(directory).glob(f"{STEP_PREFIX}*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete step checkpoints, and the temporary
    directories of saves that a killed process left behind."""
    for old in step_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    leftovers = [".*.tmp", ".*.old", ".*.download-*"]  # killed saves, replacements and downloads from a store
    for leftover in [p for pattern in leftovers for p in Path(directory).glob(pattern)]:
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
    stages = sorted(sub for sub in path.glob("*/checkpoints") if sub.is_dir()) if path.is_dir() else []
    if stages and not ckpts.is_dir():  # a job of several stages (two-branch: one run per task)
        runs = ", ".join(str(s.parent) for s in stages)
        raise CheckpointError(
            f"'{path}' holds the runs of several stages, each with its own checkpoints: name one of them ({runs})"
        )
    if path.is_dir() and not ckpts.is_dir():
        _require_complete(path)  # raises with the precise reason
    raise CheckpointError(f"no complete checkpoint under '{path}'")


def check_checkpoint_fits_job(
    directory: Path, build_model, job: dict, feature_dim: int | None, vocab_size: int | None, action: str
) -> None:
    """Raise IncompatibleCheckpoint, saying what differs, unless the checkpoint holds the
    model `build_model()` makes (read from the weights' header alone)."""
    directory = Path(directory)
    meta = read_meta(directory)
    shapes = (
        sharded_state.tensor_shapes(directory / SHARDED_DIR)
        if _weights_in_shards(directory)
        else upgrades.checkpoint_shapes(directory / "model.safetensors")
    )
    names = upgrades.upgrade_parameter_names(shapes, meta)
    saved = {names[n]: shape for n, shape in shapes.items()}
    upgrades.check_parameter_shapes(
        directory,
        upgrades.expected_shapes(build_model),
        saved,
        meta,
        read_config(directory),
        job,
        feature_dim,
        vocab_size,
        action,
    )


def check_engine_fits(directory: Path, meta: dict, backend: str) -> None:
    """Raise IncompatibleCheckpoint unless the checkpoint's optimizer state is `backend`'s:
    Accelerate saves one whole optimizer file, DeepSpeed its own shards."""
    saved = meta.get("engine")
    if saved is None or saved == backend:
        return
    raise IncompatibleCheckpoint(
        f"checkpoint '{directory}' was written by engine.backend={saved}, and this job runs engine.backend={backend}: "
        f"its optimizer state is {saved}'s, which the other engine cannot read. Resume with "
        f"engine.backend={saved} (its weights, model.safetensors, evaluate and export under either)."
    )


def write_failed(directory: Path, error: str, checkpoints: Path) -> CheckpointWriteError:
    """The error for a checkpoint that could not be written: the cause, a full disk said in words
    (torch reports one as "unexpected pos ..."), and the previous checkpoint, which is intact."""
    previous = step_checkpoints(checkpoints)
    free = shutil.disk_usage(checkpoints).free
    needed = sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file()) if previous else 0
    full = (
        f" The disk is full: {free / 2**20:.1f} MiB free, a checkpoint takes {needed / 2**20:.1f} MiB."
        if free < needed
        else ""
    )
    kept = (
        f"The previous checkpoint {previous[-1]} is complete and usable: free space (or move output.dir "
        "to a larger disk) and run again with train.resume=latest to carry on from it."
        if previous
        else "No earlier checkpoint exists: free space and start the run again."
    )
    return CheckpointWriteError(f"cannot write checkpoint {directory}: {error}.{full} {kept}")
