"""The DeepSpeed backend: DeepSpeed's own engine (`deepspeed.initialize`), ZeRO stage 0-3.

Driven directly rather than through Accelerate's DeepSpeed plugin, which needs `transformers` and,
on CPU, counts a world of 1 while DeepSpeed counts 2. vldist's own torch optimizer is handed to
DeepSpeed (no fused/CPU Adam op to compile, and torch's default Adam, not its fused one: ZeRO
re-partitions the optimizer's parameters, training/optimizers.py); the LR schedule stays vldist's.

What differs from DDP, and is handled here:
- DeepSpeed clips inside `engine.step()` (to `gradient_clipping`) and reports the norm before
  clipping; accumulation boundaries are set by the trainer, one `step()` per optimizer step.
- Under ZeRO-3 each rank holds a slice of every parameter: whole weights exist only inside
  `full_weights()`, which every rank must enter, and rank 0 evaluates a plain copy (a forward
  through the ZeRO-3 module on one rank alone desynchronises the ranks).
- Checkpoints are DeepSpeed's sharded files (one optimizer shard per rank), loaded with
  `torch.load(weights_only=True)`: DeepSpeed's default loader unpickles arbitrary objects.
- A checkpoint of another world size (or of ZeRO 1 under 2, or 2 under 1) goes through DeepSpeed's
  universal checkpoint (checkpoint/resharding.py): DeepSpeed refuses ZeRO shards of another data-parallel size.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vldist.checkpoint.resharding import load_resharded, refuse_unconvertible
from vldist.distributed.cuda_settings import configure_fp32_math
from vldist.distributed.deepspeed_config import deepspeed_config, deepspeed_precision
from vldist.distributed.engine import Engine, pick_device
from vldist.distributed.teardown import leave_process_group, release_process_groups_at_exit
from vldist.errors import ConfigError
from vldist.launch.environment import adopt_single_process_environment, adopt_slurm_environment
from vldist.launch.network import choose_gloo_interface

SUBDIR, TAG = "deepspeed", "zero"


def _import_deepspeed(on_cuda: bool):
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")  # read at import
    import deepspeed

    if not on_cuda:
        # deepspeed.comm compiles a shared-memory all-reduce op on CPU (30-40 s, every fresh
        # machine). gloo does the same job; marking the op incompatible skips the build.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _weights_only_classes() -> list:
    """What DeepSpeed's checkpoint files hold besides tensors and plain containers: a few of its
    data classes, allow-listed by name for torch.load(weights_only=True)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _weights_only_checkpoint_engine(deepspeed):
    """DeepSpeed's torch checkpoint engine, loading with weights_only=True."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    safe = _weights_only_classes()

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(safe):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine()


class DeepSpeedEngine(Engine):
    def __init__(self, job):
        """job: the JobConfig (train.device, the engine section, the batch and clipping settings)."""
        if job.train.checkpoint_format != "plain" or job.train.async_checkpoints:
            raise ConfigError(
                "train.checkpoint_format=sharded and train.async_checkpoints are the Accelerate engine's; "
                "DeepSpeed writes its own shards, each rank its part, synchronously. Leave them at their "
                "defaults under engine.backend=deepspeed"
            )
        device = pick_device(job.train.device)
        adopt_slurm_environment()
        if not dist.is_initialized():  # Ray Train made the group itself
            adopt_single_process_environment()  # plain `python -m vldist.train`: a world of one, not MPI
        choose_gloo_interface()  # multi-host without GLOO_SOCKET_IFNAME: the interface towards MASTER_ADDR
        self.deepspeed = _import_deepspeed(device.type == "cuda")
        self.deepspeed.init_distributed(
            dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=job.engine.timeout_s)
        )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", self.local_rank) if device.type == "cuda" else device
        if device.type == "cuda":
            torch.cuda.set_device(self.device)
        configure_fp32_math(self.device, job.engine.tf32)
        self.job = job
        self.config = deepspeed_config(job, self.world_size, device.type == "cuda")
        self.precision = deepspeed_precision(job, device.type == "cuda")
        self.stage = int(self.config.get("zero_optimization", {}).get("stage", 0))
        self.uniform_shapes = self.stage == 3
        self.optimizers = {}
        # meshes: DeepSpeed builds device meshes for some of its parallelism settings (sequence and
        # tensor parallelism in a user's engine.deepspeed_config)
        release_process_groups_at_exit(meshes=True)

    def setup(
        self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], dynamic_graph: bool = False
    ) -> nn.Module:
        if len(optimizers) != 1:
            raise ConfigError(
                f"engine.backend=deepspeed drives one optimizer; this recipe has {len(optimizers)} "
                f"({', '.join(optimizers)}). Use engine.backend=accelerate."
            )
        ((name, optimizer),) = optimizers.items()
        self.model, _, _, _ = self.deepspeed.initialize(
            model=model.to(self.device), optimizer=optimizer, config=self.config, dist_init_required=False
        )
        self.model.checkpoint_engine = _weights_only_checkpoint_engine(self.deepspeed)
        # torch LR schedulers refuse DeepSpeed's ZeRO wrapper; it shares the param_group dicts of
        # the optimizer it wraps, so schedulers attach to the torch optimizer.
        self.optimizers = {name: optimizer}
        return self.model

    def micro_batch(self, last: bool):
        self.model.set_gradient_accumulation_boundary(last)  # reduce gradients on the last only
        return contextlib.nullcontext()

    def backward(self, loss_share: torch.Tensor, micro_batches: int = 1) -> None:
        # DeepSpeed averages gradients over the data-parallel ranks, like DDP.
        self.model.backward(loss_share * (self.world_size / micro_batches), scale_wrt_gas=False)

    def step(self, name: str = "main", max_norm: float | None = None) -> float:
        if (max_norm or 0.0) != self.config["gradient_clipping"]:
            raise ValueError(
                f"clip norm {max_norm} differs from DeepSpeed's gradient_clipping {self.config['gradient_clipping']}"
            )
        self.model.set_gradient_accumulation_boundary(True)
        self.model.step()  # clip, update, zero the gradients
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrap(self) -> nn.Module:
        return self.model.module

    def full_weights(self):
        if self.stage != 3:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(list(self.unwrap().parameters()), modifier_rank=None)

    def evaluation_model(self, build):
        if self.stage != 3:
            return super().evaluation_model(build)
        # A forward through the ZeRO-3 module on rank 0 alone would leave the ranks' parameter
        # fetch schedules out of step (the next training forward then waits forever).
        return self.plain_copy(build)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        module = self.unwrap()
        if self.stage != 3:
            module.load_state_dict(state)
            return
        # Every rank loads the buffers (ZeRO-3 does not partition them); rank 0's parameter
        # values are scattered back into the slices on leaving the block.
        with self.deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            module.load_state_dict(state)

    def save_training_state(self, directory: Path) -> None:
        # Frozen weights are in model.safetensors already; DeepSpeed need not keep a second copy.
        self.model.save_checkpoint(
            str(Path(directory) / SUBDIR), tag=TAG, client_state={}, save_latest=False, exclude_frozen_parameters=True
        )

    def checkpoint_meta(self) -> dict:
        return {"zero_stage": self.stage}

    def load_training_state(self, directory: Path, saved: dict) -> None:
        from vldist.errors import CheckpointError

        path = Path(directory) / SUBDIR
        saved_world, saved_stage = saved.get("world_size", self.world_size), saved.get("zero_stage", self.stage)
        refuse_unconvertible(directory, saved_stage, self.stage)
        if self.stage and (
            saved_world != self.world_size or saved_stage != self.stage
        ):  # stage 0: whole state, any size
            load_resharded(self.model, path, TAG, _weights_only_classes(), directory, saved_world, self.world_size)
            return
        try:
            loaded, _ = self.model.load_checkpoint(
                str(path), tag=TAG, load_module_strict=False, load_lr_scheduler_states=False
            )
        except Exception as err:  # noqa: BLE001 - DeepSpeed raises many types on damaged files
            raise CheckpointError(
                f"cannot read the DeepSpeed state in {path} ({err}); the checkpoint is damaged"
            ) from err
        if loaded is None:
            raise CheckpointError(
                f"no DeepSpeed state in {path}: written by another engine? Resume with the same engine.backend"
            )

    def barrier(self) -> None:
        dist.barrier()

    def close(self, keep_process_group: bool = False, peers_lost: bool = False) -> None:
        if self.model is not None:
            self.model.destroy()
            self.model = None  # DeepSpeed's engine holds the groups it runs on
        leave_process_group(keep_process_group, peers_lost)
