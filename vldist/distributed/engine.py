"""The engine: where the model runs and how an optimizer step is taken. The trainer sees only this.

Three backends implement it: `AccelerateEngine` (DDP through Accelerate), `DeepSpeedEngine`
(DeepSpeed's own engine, ZeRO stage 0-3) and `FSDPEngine` (PyTorch's FSDP2, `fully_shard`). All run one process or many (torchrun, Slurm, Ray
workers) and read the launcher's environment themselves.

Conventions every backend keeps:
- Recipes return their rank's *share* of the global batch's loss (losses/distributed.py); every
  backend averages gradients over ranks, so `backward` scales the share by the world size. W ranks
  with batch B/W then take exactly the step one process takes on batch B.
- A step may be accumulated over several micro-batches: `backward(share, micro_batches=n)` divides
  by n, so the step follows the mean of the micro-batch losses; gradients are synchronised only on
  the last micro-batch (`micro_batch(last=...)` wraps its forward and backward).
- Optimizers are named. A recipe with several (a GAN's generator and discriminator) steps each by
  name; frozen parameters (requires_grad=False) belong to none and are never updated.
- Collective methods (marked so) must be called by every rank.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# Plain checkpoints of the engines that write their optimizers themselves (Accelerate, FSDP2):
# every optimizer's whole state, in one file beside the weights.
OPTIMIZER_FILE = "optimizer.pt"


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def grad_norm(params) -> float:
    grads = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


def copied_to_cpu(state):
    """A state dict with every tensor copied to CPU memory (a snapshot that training no longer changes)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: copied_to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copied_to_cpu(v) for v in state)
    return state


class Engine(ABC):
    rank: int
    world_size: int
    local_rank: int
    is_main: bool
    device: torch.device
    model: nn.Module | None = None  # as wrapped by the backend; call it for training forwards
    # what the steps compute in, engine.mixed_precision resolved on this device and backend:
    # "no" (fp32), "bf16" or "fp16" (distributed/precision.py; DeepSpeed and FSDP train fp32 on CPU)
    precision: str = "no"
    uniform_shapes: bool = False  # every rank's batches must have the same shapes (ZeRO-3)
    optimizers: dict[str, torch.optim.Optimizer]  # the torch optimizers (LR schedulers attach here)

    @abstractmethod
    def setup(
        self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], dynamic_graph: bool = False
    ) -> nn.Module:
        """Move and wrap the model; returns what the recipe calls. `dynamic_graph`: some steps
        leave parameters without gradient (alternating updates, phases)."""

    def autocast(self):
        return contextlib.nullcontext()

    def micro_batch(self, last: bool):
        """Wraps one micro-batch's forward and backward; gradients are synchronised on the last."""
        return contextlib.nullcontext()

    @abstractmethod
    def backward(self, loss_share: torch.Tensor, micro_batches: int = 1) -> None: ...

    @abstractmethod
    def step(self, name: str = "main", max_norm: float | None = None) -> float:
        """Clip (if max_norm), update the named optimizer, zero its gradients; returns the global
        gradient norm before clipping."""

    @abstractmethod
    def unwrap(self) -> nn.Module:
        """The recipe's own module (for evaluation forwards and state dicts)."""

    def full_weights(self):
        """Collective. A block in which every parameter is whole on every rank (ZeRO-3 gathers)."""
        return contextlib.nullcontext()

    def evaluation_model(self, build: Callable[[], nn.Module]) -> nn.Module | None:
        """Collective. On rank 0, a module with the whole current weights for evaluation forwards
        that only rank 0 runs; None elsewhere. `build` makes a fresh, unwrapped model."""
        return self.unwrap() if self.is_main else None

    def plain_copy(self, build: Callable[[], nn.Module]) -> nn.Module | None:
        """Collective. On rank 0, a fresh unwrapped module holding the whole current weights (for
        engines whose ranks hold slices: a forward through the sharded module on rank 0 alone
        would wait forever for the others' gathers); None elsewhere."""
        state = self.model_state_dict()
        if not self.is_main:
            return None
        with torch.random.fork_rng(devices=[]):  # building initialises weights: keep the training RNG as it was
            model = build()
        model.load_state_dict(state)
        return model.to(self.device)

    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. The whole model's state on rank 0, None elsewhere."""
        with self.full_weights():
            if not self.is_main:
                return None
            return {k: v.detach().cpu().clone() for k, v in self.unwrap().state_dict().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Collective. Load whole weights (every rank passes the same state)."""
        self.unwrap().load_state_dict(state)

    @abstractmethod
    def save_training_state(self, directory: Path) -> None:
        """Collective. Optimizer state (and the backend's own) into an existing directory."""

    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of how this engine cut its state (beside world size and backend)."""
        return {}

    @abstractmethod
    def load_training_state(self, directory: Path, saved: dict) -> None:
        """Collective. The inverse of save_training_state, on this engine's number of ranks, which
        may differ from the saved `world_size` (saved: the checkpoint's meta); raises
        CheckpointError when unreadable, IncompatibleCheckpoint when the state cannot be converted."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def close(self, keep_process_group: bool = False, peers_lost: bool = False) -> None:
        """Leave the process group in order, so that no rank aborts at interpreter exit: once
        destroyed, the groups are freed and their threads joined (teardown.py), at the latest
        before the interpreter's teardown (even when the caller destroys them itself).
        `keep_process_group`: another engine of this process follows (the next stage of a job)
        and joins the same group; a second rendezvous of the same ranks is not reliable.
        `peers_lost`: another rank is gone or frozen (PeerLost): no closing barrier, which would
        only wait engine.timeout_s again for it."""
