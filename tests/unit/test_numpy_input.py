"""Metric inputs as numpy arrays (vldist/metrics/numpy_input.py)."""

import numpy as np
import pytest
import torch

from vldist.metrics.numpy_input import to_numpy


def test_a_bf16_tensor_becomes_float64_with_its_values():
    x = torch.tensor([[1.5, -2.25], [3.0, 1e30]], dtype=torch.bfloat16, requires_grad=True)
    out = to_numpy(x, float64=True)
    assert out.dtype == np.float64
    assert np.array_equal(out, x.detach().double().numpy())


def test_without_float64_the_dtype_is_kept_and_bf16_is_refused():
    assert to_numpy(torch.tensor([1, 2], dtype=torch.int32)).dtype == np.int32
    assert to_numpy(torch.tensor([True])).dtype == np.bool_
    assert to_numpy([1, 2]).dtype == np.asarray([1, 2]).dtype
    with pytest.raises(TypeError):  # numpy has no bf16: the caller's check names it
        to_numpy(torch.zeros(2, dtype=torch.bfloat16))


def test_integer_tensors_and_lists_become_float64_too():
    assert to_numpy(torch.tensor([[2**53 + 1]]), float64=True).tolist() == [[float(2**53 + 1)]]
    assert to_numpy([[1, 2]], float64=True).dtype == np.float64


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, 3, dtype=torch.float64),
        lambda: np.zeros((2, 3)),
        lambda: torch.zeros(2, 3, dtype=torch.int64),
    ],
    ids=["f64 tensor", "array", "int tensor"],
)
def test_copy_never_shares_the_callers_memory(make):
    x = make()
    out = to_numpy(x, float64=True, copy=True)
    out[0, 0] = 7.0
    assert float(x[0, 0]) == 0.0
