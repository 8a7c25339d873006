"""TF32 for fp32 math is set on CUDA only (distributed/cuda_settings.py), switchable, and readable
by MFU's peak choice whichever torch API set it."""

import pytest
import torch

from vldist.distributed.cuda_settings import configure_fp32_math, tf32_matmuls
from vldist.telemetry.flops import peak_flops


@pytest.fixture
def torch_flags():
    """These are process-wide: put them back for the next test."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_cpu_leaves_torchs_flags_alone(torch_flags):
    torch.set_float32_matmul_precision("highest")
    assert configure_fp32_math(torch.device("cpu"), tf32=True) is False
    assert torch.get_float32_matmul_precision() == "highest" and not tf32_matmuls()


def test_cuda_sets_matmuls_and_convolutions_both_ways(torch_flags):
    # the flags are plain process settings: no GPU is needed to set and read them
    assert configure_fp32_math(torch.device("cuda", 0), tf32=True) is True
    assert tf32_matmuls() and torch.backends.cudnn.allow_tf32
    assert peak_flops("NVIDIA H100 80GB HBM3", "no", tf32_matmuls()) == 494e12  # MFU's peak follows
    assert configure_fp32_math(torch.device("cuda", 0), tf32=False) is False
    assert not tf32_matmuls() and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


def test_the_switch_defaults_to_on_until_the_job_says_otherwise():
    from vldist.recipes.jobs import load_config

    assert load_config("vsrn", []).engine.tf32 is True
    assert load_config("vsrn", ["engine.tf32=false"]).engine.tf32 is False
