"""The optimizers a run steps, one per named parameter group of its recipe, and their learning-rate
schedules.

Under the Accelerate engine Adam/AdamW are torch's fused ones (one kernel per step for all
parameters, instead of several per parameter list), on CUDA (bench/cuda_switches.py) and, from
torch 2.4, which has the kernel there, on CPU (bench/cpu_optimizer_step.py: VSRN's Adam step x3
faster fused at the demo's sizes, x9 at the paper's). DeepSpeed wraps the torch optimizer in its own
ZeRO optimizer, which re-partitions the parameters into flat buffers, and FSDP2's parameters are
DTensors: there vldist keeps torch's default implementation.
"""

from __future__ import annotations

import math

import torch

from vldist.config import JobConfig
from vldist.distributed.engine import pick_device

# How a step is computed, not what it computes: the run's own choice, never a checkpoint's.
STEP_IMPLEMENTATION = ("fused", "foreach")


def step_implementation(device: torch.device, backend: str) -> dict:
    """The optimizer's implementation flags for where its parameters will live: fused under the
    Accelerate engine on CUDA, and on CPU where torch has the fused kernel; torch's default (foreach
    on CUDA) elsewhere, DeepSpeed's ZeRO and FSDP2 included."""
    if backend != "accelerate":
        return {}
    return {"fused": True} if device.type == "cuda" or (device.type == "cpu" and fused_on_cpu()) else {}


def fused_on_cpu() -> bool:
    """Whether this torch has fused Adam/AdamW for CPU tensors (2.4 and later)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


def build_optimizers(
    config: JobConfig, groups: dict[str, list], device: torch.device | None = None
) -> dict[str, torch.optim.Optimizer]:
    """One torch optimizer per named group of the recipe (param-group dicts may set their own lr).
    device: where the engine will put the parameters (default: the one train.device picks, as the
    engines do); the model may still be on the CPU when its optimizers are built."""
    t = config.train
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    flags = step_implementation(device or pick_device(t.device), config.engine.backend)
    optimizers = {name: cls(params, lr=t.lr, weight_decay=t.weight_decay, **flags) for name, params in groups.items()}
    for optimizer in optimizers.values():
        optimizer.register_load_state_dict_post_hook(_keep_step_implementation)
    return optimizers


def _keep_step_implementation(optimizer: torch.optim.Optimizer) -> None:
    """load_state_dict replaces the param groups with the saved ones, flags included: a checkpoint
    of a CPU run (fused=None) would turn a CUDA run's fused steps off. This run's choice stays, and
    the step counts go where fused steps read them (torch moves them so only for fused checkpoints)."""
    for group in optimizer.param_groups:
        for key in STEP_IMPLEMENTATION:
            group[key] = optimizer.defaults[key]
        if group["fused"]:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def build_scheduler(config: JobConfig, optimizer, steps_per_epoch: int, total_steps: int):
    """The lr factor per optimizer step: warm-up, then the paper's step decay or a cosine to 0."""
    t = config.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "cosine":
            progress = (step - t.warmup_steps) / max(total_steps - t.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return t.lr_decay_factor ** (step // (t.lr_decay_epochs * steps_per_epoch))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
