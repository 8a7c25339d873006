"""The engine: where the model runs and how a step is taken. The trainer sees only this interface.

`LocalEngine` is one process on the best device present. Distributed backends (Accelerate DDP/FSDP,
DeepSpeed ZeRO) implement the same methods, so the training loop never knows which one runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class LocalEngine:
    rank = 0
    local_rank = 0
    world_size = 1
    is_main = True

    def __init__(self, device: str = "auto"):
        self.device = pick_device(device)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def autocast(self):
        return contextlib.nullcontext()  # fp32; mixed precision comes with the distributed backends

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm is None:
            return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        return float(nn.utils.clip_grad_norm_(params, max_norm))

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def close(self) -> None:
        pass
