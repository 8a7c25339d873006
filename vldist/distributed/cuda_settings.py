"""Process-wide CUDA math settings, made once where an engine picks its device.

TF32: on Ampere and later GPUs, fp32 matmuls and cuDNN convolutions can run on tensor cores with
a 10-bit mantissa (about 1e-3 relative error per product, accumulated in fp32), several times
faster than full fp32 (bench/cuda_switches.py measures it). torch leaves it off for matmuls and
on for cuDNN; vldist turns both on unless the job asks for full fp32 (e.g. to compare with a run
made before). Runs under bf16/fp16 autocast compute their matmuls in those types anyway: TF32
then applies only to what stays fp32.

torch 2.9+ has two APIs for these flags and refuses to *read* the older ones (allow_tf32,
get_float32_matmul_precision) once the newer per-backend `fp32_precision` has set them (measured
on 2.14): so the flags are set through the older setters, which Accelerate also uses and which
keep both readable, and read through the newer `fp32_precision`, which every setter updates.
"""

from __future__ import annotations

import torch


def configure_fp32_math(device: torch.device, tf32: bool = True) -> bool:
    """On CUDA, fp32 matmuls and cuDNN convolutions in TF32 (tf32=True) or in full fp32; nothing
    elsewhere. Returns whether TF32 is now on for matmuls."""
    if device.type != "cuda":
        return False
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    return tf32


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA run in TF32 now, however it was set ("none": torch's default, off)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"
