"""The FSDP2 backend: PyTorch's `fully_shard` directly behind the engine interface (engine.backend=fsdp).

Each rank holds a slice (dim 0) of every parameter, of its gradient and of the optimizer's state;
a sharded module gathers its whole weights for its forward and backward and reduce-scatters the
gradients (averaged over every rank, as DDP does). Driven directly rather than through
Accelerate's FSDP plugin, which adds a wrapping policy and a state-dict layer of its own on top of
the same calls and would sit in the way of vldist's own checkpoints.

- Units: a recipe's model may name its blocks (`fsdp_blocks`, a list of submodule names); by
  default every top-level child with parameters is one unit, then the root takes the rest.
  Children that share a parameter (tied weights) stay in the root's unit. Parameter names and
  state_dict keys stay the model's own: checkpoints are interchangeable with the other engines'
  whole weights (model.safetensors).
- engine.fsdp_shard_size=S: hybrid sharding on a 2-D mesh ("replicate", "shard"): slices within
  each group of S consecutive ranks (a node under torchrun), replicas across the groups;
  gradients are reduce-scattered within a group and all-reduced across groups.
- Mixed precision: engine.mixed_precision=bf16 on CUDA gathers bf16 weights, reduces gradients
  in fp32 and hands fp32 outputs to the losses; CPU runs fp32. fp16 is refused (FSDP2 has no
  loss scaler of torch's that reads sharded gradients).
- Accumulation: micro_batch(last=False) turns gradient reduction off (set_requires_gradient_sync);
  the unsharded gradients add up locally and are reduce-scattered once, on the last micro-batch.
- Several optimizers and frozen parameters work: each optimizer keeps its own (sharded)
  parameters; frozen ones are sharded too and gathered for the forward, never reduced.
- Checkpoints: plain (whole weights and whole optimizer state gathered on rank 0, keyed by
  parameter name, so any number of ranks loads them) or train.checkpoint_format=sharded (DCP,
  each rank its slices; dcp_checkpoints.py).
- Every rank must make the same module calls in the same order (each call gathers): batches
  have uniform shapes, as under ZeRO-3 (a caption decoder's loop over the length must not differ).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vldist.distributed.cuda_settings import configure_fp32_math
from vldist.distributed.dcp_checkpoints import DcpCheckpoints
from vldist.distributed.engine import OPTIMIZER_FILE, Engine, copied_to_cpu, pick_device
from vldist.distributed.precision import effective_precision
from vldist.distributed.teardown import leave_process_group, release_process_groups_at_exit
from vldist.errors import ConfigError
from vldist.launch.environment import adopt_single_process_environment, adopt_slurm_environment
from vldist.launch.network import choose_gloo_interface


def mesh_shape(world_size: int, shard_size: int | None) -> tuple[int, ...]:
    """(world,) for sharding over every rank; (replicas, shard_size) for hybrid sharding."""
    if shard_size is None or shard_size == world_size:
        return (world_size,)
    if shard_size > world_size or world_size % shard_size:
        raise ConfigError(
            f"engine.fsdp_shard_size={shard_size} must divide the number of ranks ({world_size}): each group of "
            f"fsdp_shard_size ranks holds one sharded replica. Use a divisor of {world_size} (the ranks of a node), "
            "or leave it unset to shard over every rank"
        )
    return (world_size // shard_size, shard_size)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own before the root: the model's `fsdp_blocks`
    (submodule names), else its top-level children with parameters; units that share a
    parameter with another are left to the root (one parameter belongs to one unit)."""
    names = getattr(model, "fsdp_blocks", None)
    units = (
        [model.get_submodule(name) for name in names]
        if names
        else [child for child in model.children() if next(child.parameters(), None) is not None]
    )
    owners: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [u for u in units if all(owners[id(p)] == 1 for p in u.parameters())]


def precision_policy(mixed_precision: str, on_cuda: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "fp16":
        raise ConfigError(
            "engine.mixed_precision=fp16 under engine.backend=fsdp: fp16 needs a loss scaler, and FSDP2's sharded "
            "gradients have none in torch. Use engine.mixed_precision=bf16 (or engine.backend=accelerate for fp16)"
        )
    if mixed_precision == "bf16" and on_cuda:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fp32 (CPU always)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class FSDPEngine(DcpCheckpoints, Engine):
    uniform_shapes = True

    def __init__(self, job):
        """job: the JobConfig (train.device, the engine section)."""
        from torch.distributed.device_mesh import init_device_mesh

        device = pick_device(job.train.device)
        on_cuda = device.type == "cuda"
        precision = effective_precision(job.engine.mixed_precision, device)
        self.policy = precision_policy(precision, on_cuda)
        self.precision = precision if on_cuda else "no"  # bf16 on CUDA; fp32 on CPU
        adopt_slurm_environment()
        if not dist.is_initialized():  # Ray Train made the group itself
            adopt_single_process_environment()  # plain `python -m vldist.train`: a world of one
            choose_gloo_interface()  # multi-host without GLOO_SOCKET_IFNAME: the interface towards MASTER_ADDR
            dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timedelta(seconds=job.engine.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", self.local_rank) if on_cuda else device
        if on_cuda:
            torch.cuda.set_device(self.device)
        configure_fp32_math(self.device, job.engine.tf32)
        shape = mesh_shape(self.world_size, job.engine.fsdp_shard_size)
        self.shard_size = shape[-1]
        self.mesh = init_device_mesh(
            self.device.type, shape, mesh_dim_names=("shard",) if len(shape) == 1 else ("replicate", "shard")
        )
        self.optimizers = {}
        self._params: dict[str, list[nn.Parameter]] = {}
        release_process_groups_at_exit(meshes=True)

    def setup(
        self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], dynamic_graph: bool = False
    ) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        names = {id(p): n for n, p in model.named_parameters()}
        model = model.to(self.device)
        for unit in shard_units(model):
            fully_shard(unit, mesh=self.mesh, mp_policy=self.policy)
        fully_shard(model, mesh=self.mesh, mp_policy=self.policy)
        # fully_shard replaced every parameter by a sharded one (a DTensor) of the same name: the
        # optimizers, built on the whole ones, are pointed at them (their state is still empty).
        sharded = dict(model.named_parameters())
        for optimizer in optimizers.values():
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self.model, self.optimizers = model, dict(optimizers)
        self._params = {n: [p for g in o.param_groups for p in g["params"]] for n, o in optimizers.items()}
        return model

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        self.model.set_requires_gradient_sync(last)  # off: gradients add up unsharded, reduced on the last
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def backward(self, loss_share: torch.Tensor, micro_batches: int = 1) -> None:
        (loss_share * (self.world_size / micro_batches)).backward()  # FSDP2 averages over every rank

    def step(self, name: str = "main", max_norm: float | None = None) -> float:
        params = self._params[name]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())  # over every rank's slices
        if max_norm is not None and grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        self.optimizers[name].step()
        self.optimizers[name].zero_grad(set_to_none=True)
        return float(_full(norm))

    def unwrap(self) -> nn.Module:
        return self.model  # fully_shard changes the module's class in place: no wrapper

    def evaluation_model(self, build):
        return self.plain_copy(build)

    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # cpu_offload leaves the gathered tensors on rank 0 only; on one rank (and buffers always)
        # they are the live ones: copied
        return copied_to_cpu(state) if self.is_main else None

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # every rank cuts its slices from the whole tensors (set_model_state_dict replaces the dict's values)
        set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True))

    def save_training_state(self, directory: Path) -> None:
        self.write_training_state(directory, self.training_state_snapshot())

    def training_state_snapshot(self) -> dict | None:
        """Collective. Rank 0: every optimizer's whole state (gathered, on the CPU, keyed by
        parameter name); None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {n: get_optimizer_state_dict(self.model, o, options=options) for n, o in self.optimizers.items()}
        return {"optimizers": copied_to_cpu(state)} if self.is_main else None  # one rank: the live tensors

    def write_training_state(self, directory: Path, snapshot: dict | None) -> None:
        if snapshot is not None:
            torch.save(snapshot, Path(directory) / OPTIMIZER_FILE)

    def checkpoint_meta(self) -> dict:
        return {"fsdp_shard_size": self.shard_size}

    def load_training_state(self, directory: Path, saved: dict) -> None:
        # Both formats are keyed by parameter name and hold no cut of the saver's: any number of ranks loads them.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from vldist.checkpoint.format import load_torch_file
        from vldist.checkpoint.sharded_state import SHARDED_DIR

        if (Path(directory) / SHARDED_DIR).is_dir():  # the model's weights come with it
            self.load_sharded(directory)
            return
        state = load_torch_file(Path(directory) / OPTIMIZER_FILE)
        options = StateDictOptions(full_state_dict=True)
        for name, optimizer in self.optimizers.items():
            set_optimizer_state_dict(self.model, optimizer, state["optimizers"][name], options=options)

    def barrier(self) -> None:
        dist.barrier()

    def close(self, keep_process_group: bool = False, peers_lost: bool = False) -> None:
        self.model = None
        leave_process_group(keep_process_group, peers_lost)
