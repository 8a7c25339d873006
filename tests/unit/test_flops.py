"""MFU: counted FLOPs of a step over the device's peak."""

import pytest
import torch

from vldist.telemetry.flops import FlopCounter, peak_flops


def test_a_counted_step_gives_flops_per_sample_and_mfu():
    counter = FlopCounter(peak=1e12)
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    with counter.measure() as mode:
        layer(x).sum().backward()
    counter.counted(mode, samples=8)
    # forward 2*64*32 per sample, backward the same once more: the weight gradient only (x needs none)
    assert counter.flops_per_sample == pytest.approx(2 * 2 * 64 * 32)
    assert counter.mfu(samples=8, seconds=0.001) == pytest.approx(2 * 2 * 8 * 64 * 32 / 0.001 / 1e12)
    with counter.measure() as again:
        assert again is None  # counted once; later steps are not slowed down


def test_the_counted_step_runs_with_dynamo_forced_eager_and_the_stance_comes_back():
    """Under the counter's dispatch mode torch 2.11's dynamo would mark a compiled model as never
    to compile; the counted step keeps dynamo out, and the stance is restored, also on an error."""
    from torch._dynamo import eval_frame  # its _stance is replaced at each change: read it there

    with FlopCounter(peak=1e12).measure() as mode:
        assert mode is not None and eval_frame._stance.stance == "force_eager"
    assert eval_frame._stance.stance == "default"
    with pytest.raises(RuntimeError, match="a failing step"), FlopCounter(peak=1e12).measure():
        raise RuntimeError("a failing step")
    assert eval_frame._stance.stance == "default"


def test_peaks_by_gpu_name_and_precision_and_none_when_unknown():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "no", tf32=True) == 156e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "no", tf32=False) == 19.5e12
    assert peak_flops("Some Future GPU", "bf16", tf32=False) is None
    assert FlopCounter(peak=None).mfu(8, 1.0) is None  # CPU or unknown device: no MFU series
