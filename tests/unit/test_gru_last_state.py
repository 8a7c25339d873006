"""vldist.models.gru_last_state: the written-out GRU (forward without autograd, hand-written
backward with batched weight gradients) against nn.GRU over the same packed batch, in float64:
the last states and the gradients of the input and of all four parameters."""

import pytest
import torch
from torch import nn

from vldist.models.common import last_hidden_gru, last_hidden_packed
from vldist.models.gru_last_state import _PackedGRULastState, last_hidden_state, takes_written_out_path

TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "lengths",
    [
        [6, 6, 6, 6],  # nothing padded
        [3, 6, 1, 4],  # ragged, unsorted, one sequence of a single step
        [2, 2, 5, 5, 1],
    ],
)
def test_last_states_and_gradients_equal_nn_gru_over_the_packed_batch(lengths):
    torch.manual_seed(0)
    gru = nn.GRU(5, 7, batch_first=True).double()
    for p in gru.parameters():  # biases away from zero, so every bias gradient is checked
        nn.init.uniform_(p, -0.8, 0.8)
    lengths = torch.tensor(lengths)
    x = torch.randn(len(lengths), int(lengths.max()), 5, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(len(lengths), 7, dtype=torch.float64)
    got = last_hidden_state(gru, x, lengths)
    ref = last_hidden_packed(gru, x, lengths)
    torch.testing.assert_close(got, ref, **TOL)
    inputs = [x, *gru.parameters()]
    for a, b in zip(
        torch.autograd.grad((got * upstream).sum(), inputs),
        torch.autograd.grad((ref * upstream).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **TOL)


def test_gradcheck_against_finite_differences():
    """The hand-written backward against finite differences of the forward (float64)."""
    g = torch.Generator().manual_seed(1)
    batch_sizes = torch.tensor([3, 3, 2, 1])  # three sequences of 4, 3 and 2 steps, packed
    data = torch.randn(int(batch_sizes.sum()), 3, dtype=torch.float64, generator=g)
    weights = [torch.randn(shape, dtype=torch.float64, generator=g) * 0.5 for shape in ((12, 3), (12, 4), (12,), (12,))]
    inputs = [t.requires_grad_() for t in (data, *weights)]
    assert torch.autograd.gradcheck(lambda d, *w: _PackedGRULastState.apply(d, batch_sizes, *w), tuple(inputs))


def test_last_hidden_gru_takes_it_on_cpu_fp32_and_not_where_it_does_not_apply():
    gru = nn.GRU(5, 7, batch_first=True)
    x, lengths = torch.randn(4, 6, 5), torch.tensor([3, 6, 1, 4])
    assert takes_written_out_path(gru, x)
    torch.testing.assert_close(last_hidden_gru(gru, x, lengths), last_hidden_packed(gru, x, lengths))
    assert not takes_written_out_path(nn.GRU(5, 7, batch_first=True, bidirectional=True), x)
    assert not takes_written_out_path(nn.GRU(5, 7, num_layers=2, batch_first=True), x)
    assert not takes_written_out_path(nn.GRU(5, 7, batch_first=True, bias=False), x)
    assert not takes_written_out_path(gru, x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_written_out_path(gru, x)
    gru.weight_hh_l0.ds_id = 0  # ZeRO-3 gathers it only in the GRU's own hooks
    assert not takes_written_out_path(gru, x)
