"""The engine: where the model runs and how a step is taken. The trainer sees only this interface.

`AccelerateEngine` runs one process or many (torchrun, Slurm, Ray workers): Accelerate sets up the
process group from the launcher's environment (gloo on CPU, NCCL on CUDA) and wraps the model in
DDP. Recipes return their rank's share of the global loss (see losses/distributed.py); since DDP
averages gradients over ranks, backward scales the share by the world size, which makes W ranks
of batch B/W take exactly the step one process takes on batch B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from vldist.dist.launch_env import adopt_slurm_environment
from vldist.models.global_batchnorm import convert_global_batchnorm


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def grad_norm(params: list[nn.Parameter]) -> float:
    grads = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


class AccelerateEngine:
    def __init__(self, device: str = "auto", mixed_precision: str = "no", sync_batchnorm: bool = False):
        from accelerate import Accelerator

        adopt_slurm_environment()  # srun tasks -> RANK/WORLD_SIZE/...; torchrun sets them itself
        on_cpu = pick_device(device).type == "cpu"
        self.accelerator = Accelerator(cpu=on_cpu, mixed_precision="no" if on_cpu else mixed_precision)
        state = self.accelerator.state
        self.rank, self.world_size = state.process_index, state.num_processes
        self.local_rank, self.is_main = state.local_process_index, state.is_main_process
        self.device = self.accelerator.device
        self.sync_batchnorm = sync_batchnorm
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
        """Wrap the model (after swapping in global BatchNorm if asked) and build its optimizer."""
        if self.sync_batchnorm and self.world_size > 1:
            convert_global_batchnorm(model)  # before the optimizer sees the parameters
        model = model.to(self.device)
        self.model, self.optimizer = self.accelerator.prepare(model, make_optimizer(model))
        return self.model, self.optimizer

    def autocast(self):
        return self.accelerator.autocast()

    def backward(self, loss_share: torch.Tensor) -> None:
        self.accelerator.backward(loss_share * self.world_size)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        if max_norm is None:
            return grad_norm(list(self.model.parameters()))
        return float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """Leave the process group in order, so no rank aborts at interpreter exit."""
        self.accelerator.end_training()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def make_engine(config) -> AccelerateEngine:
    e = config.engine
    return AccelerateEngine(config.train.device, e.mixed_precision, e.sync_batchnorm)
