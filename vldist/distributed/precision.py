"""engine.mixed_precision=auto: bf16 autocast where the device computes bf16 products natively, else fp32.

Resolved where the engine knows its device, not in the config: the saved config keeps what the user
asked (`auto`), and the same job file picks what fits each machine it runs on."""

from __future__ import annotations

import torch

# torch's own cpuinfo checks: AMX tiles (Intel Sapphire Rapids and later) and AVX512-BF16's dot
# products (AMD Zen 4 and later, Intel Cooper Lake). A torch without a check answers no for it.
CPU_BF16_CHECKS = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")


def cpu_has_native_bf16() -> bool:
    """Where oneDNN computes bf16 GEMMs natively. Measured (docs/performance.md, "bf16 on the CPU"):
    a phrase-stage step 2.07x faster under bf16 autocast on an Intel Xeon with AMX, 2.19x on an
    AMD EPYC with AVX512-BF16 and no AMX. Other CPUs convert bf16 to fp32 around every product
    and stay fp32 under auto (not measured: no such machine here)."""
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in CPU_BF16_CHECKS)


def cuda_has_native_bf16() -> bool:
    """Ampere (compute capability 8.0) and later, and ROCm's cards. Not torch.cuda.is_bf16_supported()
    as it is called by default: that also says yes for a card that only emulates bf16, slowly (a
    V100, a T4), and finds out by allocating on the current device, which a rank may not have set
    yet. The capability is read without allocating."""
    if torch.version.hip:
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def effective_precision(setting: str, device: torch.device | str) -> str:
    """`no`, `bf16` or `fp16`: the setting itself, or what `auto` means on `device`."""
    if setting != "auto":
        return setting
    kind = torch.device(device).type
    if kind == "cuda":
        return "bf16" if cuda_has_native_bf16() else "no"
    if kind == "cpu":
        return "bf16" if cpu_has_native_bf16() else "no"
    return "no"  # another accelerator: nothing measured there, and the host CPU's units are not its own
