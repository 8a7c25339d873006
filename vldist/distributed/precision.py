"""engine.mixed_precision=auto: bf16 autocast where the device has bf16 matrix units, else fp32.

Resolved where the engine knows its device, not in the config: the saved config keeps what the user
asked (`auto`), and the same job file picks what fits each machine it runs on."""

from __future__ import annotations

import torch


def cpu_has_bf16_matrix_units() -> bool:
    """AMX (Intel Sapphire Rapids and later): a bf16 GEMM ran 3.7x faster than fp32 here
    (docs/performance.md, "bf16 on the CPU"). CPUs with AVX512-BF16 but no AMX stay fp32
    under auto: unmeasured. torch's own cpuinfo check; a torch without it answers no."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def effective_precision(setting: str, device: torch.device | str) -> str:
    """`no`, `bf16` or `fp16`: the setting itself, or what `auto` means on `device`."""
    if setting != "auto":
        return setting
    if torch.device(device).type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_has_bf16_matrix_units() else "no"
