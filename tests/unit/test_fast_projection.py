"""vldist.models.projection: the 1x1-convolution path computes F.linear's product and gradients,
keeps nn.Linear's state_dict, and is only taken on CPU fp32 outside autocast above the threshold."""

import time

import pytest
import torch
from torch import nn

from vldist.models import projection
from vldist.models.gcn import RegionRelationReasoning
from vldist.models.image_encoder import RegionReasoningEncoder
from vldist.models.projection import Projection, linear, takes_conv_path


@pytest.fixture
def conv_always(monkeypatch):
    monkeypatch.setattr(projection, "MIN_CONV_MACS", 0)
    monkeypatch.setattr(projection, "KERNEL", "conv")


def _inputs(shape, transposed: bool):
    g = torch.Generator().manual_seed(0)
    if transposed:  # a non-contiguous input: the transpose of a contiguous tensor
        x = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).transpose(-1, -2)
        assert not x.is_contiguous()
    else:
        x = torch.randn(*shape, generator=g)
    return x, torch.randn(5, shape[-1], generator=g), torch.randn(5, generator=g)


@pytest.mark.parametrize("shape,transposed", [((6, 7), False), ((3, 4, 7), False), ((3, 7, 4), True), ((9, 7), True)])
def test_conv_path_equals_the_direct_product_and_its_gradients(conv_always, shape, transposed):
    x, w, b = _inputs(shape, transposed)
    assert takes_conv_path(x, w)
    for t in (x, w, b):
        t.requires_grad_()
    upstream = torch.randn(*x.shape[:-1], 5, generator=torch.Generator().manual_seed(1))
    y = linear(x, w, b)
    (y * upstream).sum().backward()

    # independently, in float64: y = x W^T + b; dL/dx = U W; dL/dW = U^T x; dL/db = sum of U's rows
    x64, w64, b64, u64 = (t.detach().double() for t in (x, w, b, upstream))
    rows_x, rows_u = x64.reshape(-1, x64.shape[-1]), u64.reshape(-1, 5)
    torch.testing.assert_close(y.double(), x64 @ w64.T + b64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), u64 @ w64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), rows_u.T @ rows_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), rows_u.sum(0), rtol=1e-5, atol=1e-5)
    assert y.shape == (*x.shape[:-1], 5)


def test_projection_keeps_linear_parameters_and_state_dict(conv_always):
    torch.manual_seed(0)
    plain = nn.Linear(7, 5)
    fast = Projection(7, 5)
    assert list(fast.state_dict()) == list(plain.state_dict()) == ["weight", "bias"]
    fast.load_state_dict(plain.state_dict())  # a checkpoint of nn.Linear loads unchanged
    x = torch.randn(4, 3, 7)
    torch.testing.assert_close(fast(x), x @ plain.weight.detach().T + plain.bias.detach())
    keys = list(RegionRelationReasoning(8).state_dict())
    assert keys[:4] == ["theta_phi_g.weight", "theta_phi_g.bias", "w_r.weight", "w_r.bias"]


def test_path_taken_only_on_cpu_fp32_outside_autocast_above_the_threshold(monkeypatch):
    monkeypatch.setattr(projection, "MIN_CONV_MACS", 1000)
    monkeypatch.setattr(projection, "KERNEL", "conv")
    x, w = torch.randn(10, 10), torch.randn(10, 10)  # 1,000 multiply-adds: at the threshold
    assert takes_conv_path(x, w)
    assert not takes_conv_path(x[:9], w)  # below it
    assert not takes_conv_path(x.bfloat16(), w.bfloat16())
    assert not takes_conv_path(x.half(), w.half())
    assert not takes_conv_path(x.double(), w.double())
    assert not takes_conv_path(torch.empty(10, 10, device="meta"), torch.empty(10, 10, device="meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_conv_path(x, w)
        assert linear(x, w).dtype == torch.bfloat16  # autocast's F.linear, not the conv path


def test_region_encoder_is_unchanged_by_the_path(monkeypatch):
    """The VSRN image encoder with every projection on the conv path equals itself on F.linear:
    outputs and parameter gradients (with padding, so the masked GRU path is covered too)."""
    torch.manual_seed(0)
    encoder = RegionReasoningEncoder(12, 8, rrr_layers=2).train()
    regions = torch.randn(3, 4, 12)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    results = []
    monkeypatch.setattr(projection, "KERNEL", "conv")
    for threshold in (float("inf"), 0):
        monkeypatch.setattr(projection, "MIN_CONV_MACS", threshold)
        encoder.zero_grad()
        image, v_star = encoder(regions, mask)
        (image.square().sum() + v_star.sum()).backward()
        results.append((image.detach(), v_star.detach(), [p.grad.clone() for p in encoder.parameters()]))
    (i0, v0, g0), (i1, v1, g1) = results
    torch.testing.assert_close(i1, i0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _slowed(product, seconds: float = 0.02):
    def slow(*args):
        time.sleep(seconds)
        return product(*args)

    return slow


def test_the_measured_choice_keeps_the_faster_kernel_and_leaves_the_random_stream_alone():
    conv, plain = projection.conv_linear, torch.nn.functional.linear
    state = torch.random.get_rng_state()
    # a 20 ms sleep dwarfs a 64 x 32 -> 16 product: the other kernel must win either way
    assert projection._time_kernels(64, 32, 16, conv=_slowed(conv), plain=plain) is False
    assert projection._time_kernels(64, 32, 16, conv=conv, plain=_slowed(plain)) is True
    assert torch.equal(torch.random.get_rng_state(), state)  # timing data from its own generator
    with torch.inference_mode():  # an evaluation's first call may be the one that times
        assert projection._time_kernels(64, 32, 16, conv=conv, plain=_slowed(plain)) is True


def test_each_shape_is_timed_once_and_the_kernel_can_be_fixed(monkeypatch):
    timed = []

    def fake_time(rows, n_in, n_out):
        timed.append((rows, n_in, n_out))
        return n_out == 6  # "the convolution is faster" for 6 outputs only

    monkeypatch.setattr(projection, "_time_kernels", fake_time)
    monkeypatch.setattr(projection, "_conv_faster", {})
    monkeypatch.setattr(projection, "MIN_CONV_MACS", 100)
    w5, w6 = torch.randn(5, 7), torch.randn(6, 7)
    assert not takes_conv_path(torch.randn(10, 7), w5)
    assert takes_conv_path(torch.randn(10, 7), w6)
    assert takes_conv_path(torch.randn(12, 7), w6)  # rows 9-16 share a power-of-two bucket: not timed again
    assert timed == [(10, 7, 5), (10, 7, 6)]
    assert not takes_conv_path(torch.randn(2, 7), w6)  # 84 multiply-adds: under the threshold, never timed
    assert timed == [(10, 7, 5), (10, 7, 6)]
    monkeypatch.setattr(projection, "KERNEL", "linear")
    assert not takes_conv_path(torch.randn(10, 7), w6)
    monkeypatch.setattr(projection, "KERNEL", "conv")
    assert takes_conv_path(torch.randn(10, 7), w5)
    assert len(timed) == 2
