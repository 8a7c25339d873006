"""train.checkpoint_format=sharded for the engines whose state torch.distributed.checkpoint reads
by parameter name (Accelerate's DDP, FSDP2): each rank writes its part, any number of ranks loads."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from vldist.checkpoint import sharded_state


class DcpCheckpoints:
    """Mixed into an engine with `unwrap()`, `optimizers` and `_scaler_state()`."""

    _checkpoint_group = None  # asynchronous sharded saves' own process group

    def _scaler_state(self) -> dict:
        """Small state of the engine's own saved beside the optimizers' (a loss scaler's); none by default."""
        return {}

    def save_sharded(self, directory: Path, asynchronous: bool):
        """Collective. Model and optimizers through torch.distributed.checkpoint, each rank its part;
        asynchronous: returns the future of the background write."""
        if asynchronous and dist.is_initialized() and self._checkpoint_group is None:
            # DCP's own collectives run in its writing thread: on a group of their own, so that they
            # never interleave with the training step's on the default group; and gloo, which DCP's
            # asynchronous save requires (it refuses an NCCL-only group, measured on an H100).
            self._checkpoint_group = dist.new_group(backend="gloo")
        return sharded_state.save(
            self.unwrap(),
            self.optimizers,
            directory,
            asynchronous,
            self._checkpoint_group if asynchronous else None,
            self._scaler_state(),
        )

    def load_sharded(self, directory: Path) -> dict:
        """Collective. The state `save_sharded` wrote into `directory`/sharded, on any number of
        ranks; returns the engine's own extra state. CheckpointError when unreadable."""
        from vldist.errors import CheckpointError

        try:
            return sharded_state.load(
                self.unwrap(), self.optimizers, Path(directory) / sharded_state.SHARDED_DIR, self._scaler_state()
            )
        except Exception as err:  # noqa: BLE001 - DCP raises CheckpointException, RuntimeError, ...
            raise CheckpointError(
                f"cannot read the sharded state in {directory} ({err}); the checkpoint is damaged"
            ) from err
