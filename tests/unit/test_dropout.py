"""vldist's dropout (models/dropout.py): on the CPU a mask from one uniform draw, kept where the draw
is at or above p and scaled by 1 / (1 - p); F.dropout elsewhere, in evaluation and at p = 0; the
trainer's swap of every nn.Dropout, torch's own layers' included."""

import pytest
import torch
from torch import nn

from vldist.models.dropout import Dropout, dropout, use_uniform_dropout_masks


def _expected(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The dropout written out: one torch.rand over x's shape under `seed`, kept at >= p."""
    torch.manual_seed(seed)
    u = torch.rand(x.shape)
    return torch.where(u >= p, x / (1 - p), torch.zeros_like(x))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_cpu_mask_keeps_1_minus_p_and_scales_what_it_keeps(p):
    x = torch.randn(64, 128, 32)
    torch.manual_seed(3)
    out = dropout(x, p, training=True)
    torch.testing.assert_close(out, _expected(x, p, 3), rtol=1e-6, atol=0)
    kept = (out != 0).double().mean().item()
    sigma = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma, kept


def test_one_time_major_draw_takes_the_masks_of_a_draw_per_step():
    """What the decoders' teacher forcing relies on: dropout over (T, B, H) at once equals T
    dropouts over (B, H) in turn, from the same seed, with one or two threads."""
    x = torch.randn(7, 5, 11)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            whole = dropout(x, 0.3, training=True)
            torch.manual_seed(0)
            steps = torch.stack([dropout(x[t], 0.3, training=True) for t in range(len(x))])
            assert torch.equal(whole, steps)
    finally:
        torch.set_num_threads(threads)


def test_the_gradient_is_the_scaled_mask():
    x = torch.randn(40, 30, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(40, 30, dtype=torch.float64)
    torch.manual_seed(1)
    out = dropout(x, 0.25, training=True)
    (out * weights).sum().backward()
    keep = _expected(torch.ones_like(x), 0.25, 1)  # 1 / (1 - p) where kept, 0 elsewhere
    torch.testing.assert_close(x.grad, weights * keep.double())
    torch.testing.assert_close(out.detach(), x.detach() * keep.double())


def test_off_in_evaluation_at_p_0_and_everything_dropped_at_p_1():
    x = torch.randn(6, 9)
    assert torch.equal(dropout(x, 0.5, training=False), x)
    assert torch.equal(dropout(x, 0.0, training=True), x)
    assert torch.equal(dropout(x, 1.0, training=True), torch.zeros_like(x))
    module = Dropout(0.5).eval()
    assert torch.equal(module(x), x)


def test_bf16_keeps_its_dtype_and_the_mask():
    x = torch.randn(50, 40).bfloat16()
    torch.manual_seed(2)
    out = dropout(x, 0.2, training=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out != 0, _expected(torch.ones(50, 40), 0.2, 2) != 0)


def test_the_swap_replaces_every_nn_dropout_and_keeps_the_state_dict():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.2, batch_first=True)
    model = nn.Sequential(layer, nn.Dropout(0.4), nn.Linear(16, 16), Dropout(0.3))
    model[1].eval()
    keys = list(model.state_dict())
    x = torch.randn(3, 5, 16)
    model.eval()
    before = model(x)
    model.train()
    model[1].eval()
    # the layer's dropout, dropout1 and dropout2, and the Sequential's nn.Dropout; not vldist's own
    assert use_uniform_dropout_masks(model) == 4
    assert not any(type(m) is nn.Dropout for m in model.modules())
    assert [m.p for m in model.modules() if isinstance(m, Dropout)] == [0.2, 0.2, 0.2, 0.4, 0.3]
    assert not model[1].training and layer.dropout1.training  # each module keeps its mode
    assert list(model.state_dict()) == keys
    model.eval()
    assert torch.equal(model(x), before)  # nothing changes in evaluation
    model.train()
    torch.manual_seed(4)
    first = model(x)
    torch.manual_seed(4)
    assert torch.equal(model(x), first) and not torch.equal(first, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_it_is_f_dropout():
    x = torch.randn(32, 64, device="cuda")
    torch.manual_seed(0)
    ours = dropout(x, 0.3, training=True)
    torch.manual_seed(0)
    assert torch.equal(ours, torch.nn.functional.dropout(x, 0.3, training=True))
