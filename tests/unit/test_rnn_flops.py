"""cuDNN's fused RNN ops are counted: the analytic formulas (telemetry/rnn_flops.py) against what
FlopCounterMode counts on CPU, where nn.GRU / nn.LSTM / nn.RNN decompose into counted addmm/mm
(2 FLOPs per multiply-add of each GEMM; bias adds and gate math are not counted by either)."""

import copy
import inspect

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from vldist.telemetry.flops import FlopCounter
from vldist.telemetry.rnn_flops import cudnn_rnn_backward_flop, cudnn_rnn_flop, rnn_flop_formulas

# torch.backends.mkldnn.flags() also sets oneDNN's TF32 switch, which warns on builds without Intel GPUs
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
aten = torch.ops.aten
MODES = {torch.nn.GRU: 3, torch.nn.LSTM: 2, torch.nn.RNN: 1}  # cudnnRNNMode_t: GRU, LSTM, RNN_TANH
T, B, IN, H = 5, 3, 4, 6
LENGTHS = [5, 3, 2]  # packed: rows per step 3,3,2,1,1


def _cpu_count(rnn, packed: bool, backward: bool, h0_grad: bool = True, input_grad: bool = True):
    """FlopCounterMode's count on CPU (oneDNN off: its fused LSTM kernel is no more counted than cuDNN's)."""
    x = torch.randn(B, T, IN) if rnn.batch_first else torch.randn(T, B, IN)
    x.requires_grad_(input_grad)
    out_size = rnn.proj_size or rnn.hidden_size
    shape = (rnn.num_layers * (2 if rnn.bidirectional else 1), B)
    h0 = torch.randn(*shape, out_size, requires_grad=h0_grad)
    state = (h0, torch.randn(*shape, rnn.hidden_size, requires_grad=h0_grad)) if isinstance(rnn, torch.nn.LSTM) else h0
    inputs = pack_padded_sequence(x, LENGTHS, batch_first=rnn.batch_first) if packed else x
    with torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as mode:
        out, _ = rnn(inputs, state)
        if backward:
            (out.data if packed else out).sum().backward()
    return mode.get_total_flops()


def _cudnn_arguments(rnn, packed: bool) -> dict:
    """What aten._cudnn_rnn receives for this module and input, as meta tensors (shapes only)."""
    directions = 2 if rnn.bidirectional else 1
    meta = {"device": "meta"}
    if packed:
        x, batch_sizes = torch.empty(sum(LENGTHS), IN, **meta), [3, 3, 2, 1, 1]
    else:
        x, batch_sizes = torch.empty(*((B, T, IN) if rnn.batch_first else (T, B, IN)), **meta), []
    state = (rnn.num_layers * directions, B)
    lstm = isinstance(rnn, torch.nn.LSTM)
    return {
        "input": x,
        "weight": [torch.empty(p.shape, **meta) for p in rnn.parameters()],
        "weight_stride0": 4 if rnn.bias else 2,
        "weight_buf": None,
        "hx": torch.empty(*state, rnn.proj_size or rnn.hidden_size, **meta),
        "cx": torch.empty(*state, rnn.hidden_size, **meta) if lstm else None,
        "mode": MODES[type(rnn)],
        "hidden_size": rnn.hidden_size,
        "proj_size": rnn.proj_size,
        "num_layers": rnn.num_layers,
        "batch_first": rnn.batch_first,
        "dropout": 0.0,
        "train": True,
        "bidirectional": rnn.bidirectional,
        "batch_sizes": batch_sizes,
        "dropout_state": None,
    }


def _counted_cudnn_forward(arguments: dict) -> int:
    """The real op, dispatched (its meta kernel) under vldist's counter: the mapping and the op's
    argument order are what is tested, not a direct call of the formula."""
    counter = FlopCounter(peak=1.0)
    with counter.measure() as mode:
        schema = aten._cudnn_rnn.default._schema
        aten._cudnn_rnn.default(*(arguments[a.name] for a in schema.arguments))
    return mode.get_total_flops()


def _backward_formula(arguments: dict, weights_need_grad: bool = True) -> int:
    shapes = {k: (v.shape if isinstance(v, torch.Tensor) else v) for k, v in arguments.items()}
    if shapes["weight"]:
        shapes["weight"] = [w.shape for w in arguments["weight"]]
    extra = {"output": None, "grad_output": None, "grad_hy": None, "grad_cy": None, "reserve": None}
    return cudnn_rnn_backward_flop(**shapes, **extra, output_mask=[True, True, True, weights_need_grad])


CASES = [  # (module, packed)
    (torch.nn.GRU(IN, H, num_layers=1, batch_first=True), False),
    (torch.nn.GRU(IN, H, num_layers=2, bidirectional=True), True),
    (torch.nn.GRU(IN, H, num_layers=2), True),
    (torch.nn.LSTM(IN, H, num_layers=1, bidirectional=True), False),
    (torch.nn.LSTM(IN, H, num_layers=2, proj_size=2), True),
    (torch.nn.RNN(IN, H, num_layers=2, bidirectional=True), False),
]


@pytest.mark.parametrize("rnn,packed", CASES, ids=lambda c: repr(c) if isinstance(c, torch.nn.Module) else str(c))
def test_analytic_cudnn_counts_equal_the_cpu_decomposition(rnn, packed):
    arguments = _cudnn_arguments(rnn, packed)
    forward = _counted_cudnn_forward(arguments)
    assert forward == _cpu_count(rnn, packed, backward=False)
    # input and h0 need gradients: the CPU then runs every data-gradient GEMM that cuDNN runs
    assert forward + _backward_formula(arguments) == _cpu_count(rnn, packed, backward=True)


def test_cudnn_counts_the_data_gradients_the_cpu_skips():
    """VSRN's case: h0 defaults to zeros (no gradient). cuDNN still computes dh0, and dx of an input
    that needs none; the CPU skips those GEMMs: 2*B*H*3H per layer and direction for h0 (each
    sequence's first step), 2*T*B*IN*3H per direction for the input. Nothing else differs."""
    rnn = torch.nn.GRU(IN, H, num_layers=2, bidirectional=True)
    arguments = _cudnn_arguments(rnn, packed=False)
    analytic = _counted_cudnn_forward(arguments) + _backward_formula(arguments)
    cpu = _cpu_count(rnn, packed=False, backward=True, h0_grad=False, input_grad=False)
    skipped_h0 = 2 * 2 * (2 * B * H * 3 * H)  # layers * directions * (first step's recurrent GEMM)
    skipped_input = 2 * (2 * T * B * IN * 3 * H)  # directions * (layer 0's input GEMM)
    assert analytic - cpu == skipped_h0 + skipped_input


def test_frozen_weights_count_the_data_gradients_only():
    arguments = _cudnn_arguments(torch.nn.GRU(IN, H), packed=False)
    forward = _counted_cudnn_forward(arguments)
    assert _backward_formula(arguments, weights_need_grad=False) == forward
    assert _backward_formula(arguments, weights_need_grad=True) == 2 * forward


def test_formulas_take_the_ops_schema_arguments_and_stay_out_of_torchs_registry():
    for op, formula in ((aten._cudnn_rnn, cudnn_rnn_flop), (aten._cudnn_rnn_backward, cudnn_rnn_backward_flop)):
        names = [a.name for a in op.default._schema.arguments]
        assert list(inspect.signature(formula).parameters)[: len(names)] == names
    assert rnn_flop_formulas().keys() == {aten._cudnn_rnn, aten._cudnn_rnn_backward}
    assert aten._cudnn_rnn not in flop_counter.flop_registry  # per counter, not process-wide


def test_an_unknown_mode_is_refused_by_name():
    arguments = _cudnn_arguments(torch.nn.GRU(IN, H), packed=False)
    with pytest.raises(ValueError, match="cuDNN RNN mode 7"):
        _counted_cudnn_forward({**arguments, "mode": 7})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's RNN kernels)")
@pytest.mark.parametrize("rnn,packed", CASES[:2] + CASES[4:5], ids=["gru", "gru-bi-packed", "lstm-proj-packed"])
def test_on_cuda_the_counter_sees_cudnn_rnn_and_counts_what_the_cpu_counts(rnn, packed):
    cpu = _cpu_count(rnn, packed, backward=True)
    rnn = copy.deepcopy(rnn).cuda()  # CASES' modules are shared with the CPU tests
    x = torch.randn(B, T, IN) if rnn.batch_first else torch.randn(T, B, IN)
    x = x.cuda().requires_grad_()
    out_size = rnn.proj_size or rnn.hidden_size
    shape = (rnn.num_layers * (2 if rnn.bidirectional else 1), B)
    h0 = torch.randn(*shape, out_size, device="cuda", requires_grad=True)
    state = (h0, torch.randn(*shape, H, device="cuda", requires_grad=True)) if isinstance(rnn, torch.nn.LSTM) else h0
    inputs = pack_padded_sequence(x, LENGTHS, batch_first=rnn.batch_first) if packed else x
    counter = FlopCounter(peak=1.0)
    with counter.measure() as mode:
        out, _ = rnn(inputs, state)
        (out.data if packed else out).sum().backward()
    ops = mode.get_flop_counts()["Global"]
    assert aten._cudnn_rnn in ops and aten._cudnn_rnn_backward in ops  # cuDNN ran, and was counted
    assert mode.get_total_flops() == cpu
