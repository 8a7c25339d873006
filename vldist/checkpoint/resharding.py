"""Resuming a DeepSpeed ZeRO checkpoint on another number of ranks, through DeepSpeed's universal
checkpoint.

A ZeRO checkpoint holds one optimizer shard per rank, cut for the data-parallel size that wrote
it, and DeepSpeed refuses to load it on any other. Its universal checkpoint is the same state cut
per parameter instead (`deepspeed.checkpoint.ds_to_universal`); a ZeRO engine of any size loads
that. vldist converts on resume only when the size (or the ZeRO stage, 1 <-> 2) differs: every rank
converts the shards into a temporary directory of its own, loads from it and deletes it. One
conversion per rank costs a read of every shard per rank, but needs no shared scratch space and no
agreement on a path between hosts.

Converting here rather than resharding the flat buffers by hand: the layout of ZeRO's partitions
(padding, alignment, per-parameter slicing under stage 3) is DeepSpeed's and changes between its
versions; its converter follows it. What vldist adds is safety: DeepSpeed's converter and
universal loader call torch.load(weights_only=False), which would run code from a crafted file, so
they run here with every torch.load forced to weights_only=True.

ZeRO-3 (parameters partitioned) and ZeRO 1/2 (parameters whole) do not convert into each other
(DeepSpeed's universal loader fails an assertion either way, as measured with DeepSpeed 0.19.8):
such a checkpoint is refused by name.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from vldist.errors import IncompatibleCheckpoint


def refuse_unconvertible(checkpoint: Path, saved_stage: int, stage: int) -> None:
    """Raise IncompatibleCheckpoint when ZeRO state of `saved_stage` cannot become `stage`'s."""
    if (saved_stage == 3) == (stage == 3) and (saved_stage == 0) == (stage == 0):
        return
    raise IncompatibleCheckpoint(
        f"checkpoint '{checkpoint}' holds DeepSpeed ZeRO stage {saved_stage} state, and this job runs stage {stage}; "
        "DeepSpeed converts ZeRO state between stages 1 and 2 only. Resume with the engine.deepspeed_config of "
        f"stage {saved_stage} (jobs/deepspeed/zero{saved_stage}.json, on any number of ranks)."
    )


@contextlib.contextmanager
def weights_only_torch_load(safe_classes: list):
    """Inside the block every torch.load is weights_only=True, `safe_classes` allow-listed."""
    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(safe_classes):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def load_resharded(
    engine, path: Path, tag: str, safe_classes: list, checkpoint: Path, saved_world: int, world: int
) -> None:
    """Collective. Load the ZeRO state in `path`/`tag`, written by `saved_world` ranks, into the
    DeepSpeed `engine` of `world` ranks. A conversion that fails is refused with the reason."""
    from deepspeed.checkpoint import ds_to_universal

    with tempfile.TemporaryDirectory(prefix="vldist-universal-") as scratch:
        output = io.StringIO()  # the converter prints a banner and progress bars on every rank
        args = SimpleNamespace(
            input_folder=str(Path(path) / tag),
            output_folder=str(Path(scratch) / tag),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )  # vldist's module declares no tensor-parallel layout
        try:
            with (
                weights_only_torch_load(safe_classes),
                contextlib.redirect_stdout(output),
                contextlib.redirect_stderr(output),
            ):
                ds_to_universal.main(args)
                # The flag is read from the engine's config at load time; set for this load only.
                engine._config.load_universal_checkpoint = True
                loaded, _ = engine.load_checkpoint(
                    scratch, tag=tag, load_module_strict=False, load_lr_scheduler_states=False
                )
        except Exception as err:  # noqa: BLE001 - the converter raises many types (AssertionError among them)
            detail = f"{type(err).__name__}: {err}".strip().rstrip(":")
            raise IncompatibleCheckpoint(
                f"checkpoint '{checkpoint}' was written by {saved_world} ranks and DeepSpeed could not convert it "
                f"for {world} ({detail}). Resume on {saved_world} ranks."
            ) from err
        finally:
            engine._config.load_universal_checkpoint = False
        if loaded is None:
            raise IncompatibleCheckpoint(f"checkpoint '{checkpoint}': DeepSpeed found no state in its universal form")
