"""Channels-last (NHWC) for the CNN trunks on CUDA, and on CPU where a recipe measured it faster.

cuDNN's tensor-core convolutions work in NHWC; given NCHW tensors it transposes around every
convolution. With the weights and the images channels-last, the activations between convolutions
stay NHWC (a convolution's output follows its input's or weight's layout) and those copies go.
The layout changes strides only, never values: a checkpoint, a replica hash (which reads values)
and the modules' code are the same. bench/cuda_switches.py measures the gain per trunk.

On CPU oneDNN's convolutions are faster in NHWC too, but its batch-norm backward can be much slower
there, so a recipe asks for it on CPU only where its whole step measured faster: L2C's steps, 13-19%
under bf16 autocast and level in fp32; LAViTeR's phases are slower in NHWC under bf16
(bench/cpu_cnn_steps.py, docs/performance.md). The tests compare both layouts on CPU.
"""

from __future__ import annotations

import torch
from torch import nn


def channels_last_wanted(job, on_cpu: bool = False) -> bool:
    """Whether a job's model converts its CNN trunks, from its train.device: where that means a
    CUDA GPU (auto on a machine with one), and on CPU too with `on_cpu`. Not pick_device: a job
    that trained on CUDA must still build its model on a machine without one (evaluation, export).
    Never under DeepSpeed, whose engine broadcasts every parameter as a byte view when it starts,
    nor under FSDP2, whose fully_shard refuses non-contiguous parameters: both need torch's
    default layout (a channels-last weight fails there)."""
    if job.engine.backend in ("deepspeed", "fsdp"):
        return False
    device = job.train.device
    on_cuda = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
    return on_cuda or on_cpu


def convert_to_channels_last(module: nn.Module, entries: list[nn.Module]) -> None:
    """The module's 4-D weights (its convolutions) channels-last, in place; images passed to any of
    `entries` (4-D float arguments) are converted as they arrive (a forward pre-hook), so that
    callers need not know."""
    module.to(memory_format=torch.channels_last)  # Module.to converts 4-D parameters and buffers only
    for entry in entries:
        entry.register_forward_pre_hook(_images_channels_last, with_kwargs=True)


def _images_channels_last(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(_converted(a) for a in args), {k: _converted(v) for k, v in kwargs.items()}


def _converted(value):
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
        return value.contiguous(memory_format=torch.channels_last)
    return value
