"""masked_batch_norm: BatchNorm over the real rows, computed with row weights, equals BatchNorm of
the selected rows scattered back (outputs, gradients, running statistics), and keeps the RRR
layer's padded path free of data-dependent shapes, so torch.compile traces it in one graph."""

import pytest
import torch
from torch import nn

from vldist.models.gcn import RegionRelationReasoning
from vldist.models.global_batchnorm import masked_batch_norm

TOL = dict(rtol=1e-5, atol=1e-5)


def _selected(bn: nn.BatchNorm1d, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[rows] = bn(x[rows])
    return out


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("training", [True, False])
def test_weighted_rows_equal_the_selected_rows_scattered_back(momentum, training):
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(6, momentum=momentum)
    nn.init.normal_(reference.weight)
    nn.init.normal_(reference.bias)
    reference.running_mean.normal_()
    reference.running_var.uniform_(0.5, 2.0)
    masked = nn.BatchNorm1d(6, momentum=momentum)
    masked.load_state_dict(reference.state_dict())
    reference.train(training), masked.train(training)
    rows = torch.tensor([True, True, False, True, False, True, True, False, True])
    x = torch.randn(9, 6) * 3 + 5
    x[~rows] = 1e4  # whatever sits in the padding must not matter
    x.requires_grad_()
    upstream = torch.randn(9, 6)
    for _ in range(2):  # twice: the running statistics move the same way each time
        got = masked_batch_norm(masked, x, rows)
        ref = _selected(reference, x, rows)
        torch.testing.assert_close(got, ref, **TOL)
        assert (got[~rows] == 0).all()
        grads = torch.autograd.grad((got * upstream).sum(), [x, masked.weight, masked.bias])
        ref_grads = torch.autograd.grad((ref * upstream).sum(), [x, reference.weight, reference.bias])
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        for name, buffer in reference.named_buffers():
            torch.testing.assert_close(dict(masked.named_buffers())[name], buffer, **TOL, msg=name)


def test_the_padded_rrr_layer_traces_in_one_graph():
    torch.manual_seed(0)
    layer = RegionRelationReasoning(8).train()
    v = torch.randn(3, 4, 8)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    explained = torch._dynamo.explain(layer)(v, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize(("n", "real"), [(40, 35), (1200, 1001)])
def test_bf16_rows_as_autocast_gives_them_are_normalised_in_float32(n, real):
    """Under bf16 autocast the rows arrive in bf16 and the running statistics are float32: the
    statistics are computed in float32 from the bf16 values, as BatchNorm1d of those values in float32.
    1,001 real rows: a count kept in bf16 would round to 1,000 (bf16 counts exactly only to 256)."""
    torch.manual_seed(0)
    x = (torch.randn(n, 6) * 3 + 5).bfloat16()
    rows = torch.ones(n, dtype=torch.bool)
    rows[real:] = False
    masked, reference = nn.BatchNorm1d(6), nn.BatchNorm1d(6)
    got = masked_batch_norm(masked, x, rows)
    ref = _selected(reference, x.float(), rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, **TOL)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(masked.named_buffers())[name], buffer, **TOL, msg=name)
