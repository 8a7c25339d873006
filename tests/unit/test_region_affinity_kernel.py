"""The fused Triton region affinity against the PyTorch reference.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, in its own process so that
the rest of the suite, and real CUDA runs, compile normally). On CUDA the compiled kernel is
checked in fp32 and bf16 as well.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vldist.kernels.region_affinity import region_affinity, region_affinity_torch, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
CASES = Path(__file__).parent / "workers" / "kernel_cases.py"


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(CASES)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_forward_and_gradients_match_the_reference_under_the_interpreter(interpreted):
    """K = 1, odd K, K = 36 and 128, D not a multiple of the block, random padding, an image with
    no region, both normalisations; fp32 math, so within 1e-5 of the reference's scale."""
    assert len(interpreted["cases"]) == 11
    for case in interpreted["cases"]:
        assert case["forward"] < 1e-5, case
        assert max(case["grads"]) < 1e-5, case


def test_fp16_inputs_match_the_reference_to_half_precision(interpreted):
    """fp16 in and out, fp32 accumulation: within 2e-3 of the fp32 reference on the same inputs."""
    assert len(interpreted["fp16"]) == 3
    for case in interpreted["fp16"]:
        assert case["forward"] < 2e-3 and max(case["grads"]) < 2e-3, case


def test_vsrn_trains_the_same_with_either_kernel(interpreted):
    run = interpreted["vsrn"]
    assert run["triton"] == pytest.approx(run["torch"], rel=1e-5)  # 3 SGD steps of a small VSRN
    assert run["max_param_diff"] < 1e-4


@pytest.mark.parametrize(
    "device, dtype, regions, installed, expected",
    [
        ("cpu", torch.bfloat16, 36, True, "torch"),  # Triton compiles for CUDA only
        ("cuda", torch.bfloat16, 36, True, "triton"),  # measured 1.8-2.0x eager on an H100
        ("cuda", torch.float16, 9, True, "triton"),
        ("cuda", torch.float32, 36, True, "torch"),  # measured 0.6-0.8x eager: cuBLAS wins in fp32
        ("cuda", torch.float32, 9, True, "triton"),  # measured 1.5-2.2x eager
        ("cuda", torch.bfloat16, 129, True, "torch"),  # one program per image holds K x K
        ("cuda", torch.bfloat16, 36, False, "torch"),
    ],
)
def test_auto_takes_the_kernel_where_it_was_measured_faster(device, dtype, regions, installed, expected):
    from vldist.kernels.region_affinity import auto_kernel

    assert auto_kernel(device, dtype, regions, installed) == expected


def test_auto_uses_the_reference_on_cpu_and_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    theta, phi, g = (torch.randn(2, 5, 16) for _ in range(3))
    assert torch.equal(region_affinity(theta, phi, g, kernel="auto"), region_affinity_torch(theta, phi, g))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        region_affinity(theta, phi, g, kernel="triton")
    with pytest.raises(ValueError, match="kernel must be"):
        region_affinity(theta, phi, g, kernel="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("normalize", ["count", "softmax"])
def test_compiled_kernel_on_cuda(dtype, tolerance, normalize):
    """bf16: against the fp32 reference on the same bf16-rounded inputs, relative to its scale."""
    torch.manual_seed(0)
    B, K, D = 16, 36, 1024
    inputs = [torch.randn(B, K, D, device="cuda").to(dtype).requires_grad_() for _ in range(3)]
    mask = torch.rand(B, K, device="cuda") > 0.2
    mask[:, 0] = True
    out = region_affinity(*inputs, normalize, mask, kernel="triton")
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dy)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    ref = region_affinity_torch(*ref_inputs, normalize, mask)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.float())
    assert out.dtype == dtype
    assert float((out.float() - ref).abs().max()) <= tolerance * float(ref.abs().max())
    for got, want in zip(grads, ref_grads, strict=True):
        assert float((got.float() - want).abs().max()) <= tolerance * float(want.abs().max())
