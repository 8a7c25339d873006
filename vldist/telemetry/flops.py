"""Model FLOPs utilisation (MFU): the FLOP/s a training step achieves over the device's peak.

The FLOPs of a step are counted, not estimated: the first optimizer step runs under torch's
`FlopCounterMode`, which adds up every matmul, convolution and attention op that forward and
backward dispatch (elementwise ops are not counted, as in the usual MFU definition). Divided by
the step's samples this gives the recipe's FLOPs per sample; later steps reuse it. cuDNN's fused
RNN kernels (the GRUs and LSTMs on CUDA), which torch has no formula for, are counted by
rnn_flops.py's analytic formulas, the same GEMMs that the CPU decomposition counts.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

from vldist.distributed.cuda_settings import tf32_matmuls
from vldist.telemetry.rnn_flops import rnn_flop_formulas

# Dense peak TFLOP/s per GPU (vendor datasheets, SXM parts): bf16/fp16 tensor cores, and fp32
# (TF32 tensor cores where torch allows TF32 matmuls, else plain fp32).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def peak_flops(device_name: str, mixed_precision: str, tf32: bool) -> float | None:
    """The peak FLOP/s of a GPU by name for the precision the step computes in; None if unknown."""
    for model, peaks in PEAK_TFLOPS.items():
        if model in device_name.upper():
            key = "bf16" if mixed_precision in ("bf16", "fp16") else ("tf32" if tf32 else "fp32")
            return peaks[key] * 1e12
    return None


class FlopCounter:
    """Counts one step's FLOPs, then turns later steps' times into MFU."""

    def __init__(self, peak: float | None):
        self.peak = peak
        self.flops_per_sample: float | None = None

    @contextlib.contextmanager
    def measure(self):
        """A context for the step to count (only the first: counting slows a step down). A compiled
        model runs that step eager: under the counter's dispatch mode dynamo compiles nothing, and
        torch 2.11's dynamo, asked to, marks the model's frame as never to compile again (so the run
        stays eager throughout: reproduced on CPU); a stance of force_eager keeps dynamo out of that step."""
        if self.flops_per_sample is not None or self.peak is None:
            yield None
            return
        eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else None
        with (
            eager or contextlib.nullcontext(),
            FlopCounterMode(display=False, custom_mapping=rnn_flop_formulas()) as counter,
        ):
            yield counter

    def counted(self, counter, samples: int) -> None:
        if counter is not None and samples:
            self.flops_per_sample = counter.get_total_flops() / samples

    def mfu(self, samples: int, seconds: float) -> float | None:
        if self.flops_per_sample is None or self.peak is None or seconds <= 0:
            return None
        return self.flops_per_sample * samples / seconds / self.peak


def device_peak(device: torch.device, mixed_precision: str) -> float | None:
    if device.type != "cuda":
        return None  # MFU is reported on CUDA only
    return peak_flops(torch.cuda.get_device_name(device), mixed_precision, tf32_matmuls())
