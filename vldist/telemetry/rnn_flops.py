"""FLOPs of cuDNN's fused RNN kernels, which torch's FlopCounterMode has no formula for.

On CUDA, nn.GRU / nn.LSTM / nn.RNN dispatch one `aten._cudnn_rnn` op for the whole sequence (and
`aten._cudnn_rnn_backward` for its gradient), so FlopCounterMode counted 0 FLOPs for them. On CPU
the same modules decompose into addmm/mm, one per gate GEMM and time step, which it does count (2
FLOPs per multiply-add, the bias adds and gate nonlinearities not at all). These formulas count
the same GEMMs analytically from the op's arguments, so CUDA and CPU agree (tests/unit/test_rnn_flops.py):

per layer and direction, over the N rows it runs (T*B padded, sum(batch_sizes) packed):
    input GEMM       2 * N * in    * G*H      (in: input_size in layer 0, then out*directions)
    recurrent GEMM   2 * N * out   * G*H      (G gates: 3 GRU, 4 LSTM, 1 RNN; out = proj_size or H)
    projection GEMM  2 * N * H     * out      (LSTM with proj_size only)

The backward runs the same GEMMs once for the data gradients and once more for the weight
gradients (when the weights need them). cuDNN computes the data gradients unconditionally (PyTorch
always calls its backward-data pass, which also updates the reserve space), including those of the
layer's input and of h0 even where nothing needs them; the CPU decomposition skips a GEMM's input
gradient when its input needs none, so the two agree exactly when the input and h0 need gradients.

(A backward with no incoming gradient at all returns zeros without cuDNN; counted as if it ran.
ROCm's miopen_rnn and oneDNN's CPU LSTM kernel, mkldnn_rnn_layer, are not counted: MFU is reported
on CUDA only.)

GRUCell / LSTMCell need nothing here: on CUDA they run their two GEMMs as counted `linear`s and
only the elementwise gate math in `_thnn_fused_gru_cell` / `_thnn_fused_lstm_cell`, which MFU
does not count anyway.
"""

from __future__ import annotations

import torch

# cuDNN's cudnnRNNMode_t, the `mode` argument of aten._cudnn_rnn: gates per hidden unit.
GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # RNN_RELU, RNN_TANH, LSTM, GRU


def rnn_gemm_flops(
    input_shape,
    mode: int,
    hidden_size: int,
    proj_size: int,
    num_layers: int,
    bidirectional: bool,
    batch_sizes,
) -> int:
    """The FLOPs of one pass over the GEMMs of a (multi-layer, maybe bidirectional) RNN.

    input_shape: (T, B, I) or (B, T, I) padded, or (sum(batch_sizes), I) packed; batch_sizes: the
    packed sequence's rows per time step, empty when padded."""
    if mode not in GATES:
        raise ValueError(f"cuDNN RNN mode {mode} is not one of {sorted(GATES)} (RNN_RELU, RNN_TANH, LSTM, GRU)")
    rows = sum(batch_sizes) if len(batch_sizes) else input_shape[0] * input_shape[1]
    gate_width = GATES[mode] * hidden_size
    out = proj_size or hidden_size
    directions = 2 if bidirectional else 1
    total = 0
    for layer in range(num_layers):
        features_in = input_shape[-1] if layer == 0 else out * directions
        per_row = features_in * gate_width + out * gate_width + (hidden_size * proj_size if proj_size else 0)
        total += directions * 2 * rows * per_row
    return total


# Parameter names are the ops' schema argument names (the counter may pass them by keyword).
def cudnn_rnn_flop(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
    out_shape=None,
) -> int:
    return rnn_gemm_flops(input, mode, hidden_size, proj_size, num_layers, bidirectional, batch_sizes)


def cudnn_rnn_backward_flop(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    output,
    grad_output,
    grad_hy,
    grad_cy,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
    reserve,
    output_mask,
    out_shape=None,
) -> int:
    gemms = rnn_gemm_flops(input, mode, hidden_size, proj_size, num_layers, bidirectional, batch_sizes)
    return gemms * (2 if output_mask[3] else 1)  # data gradients always; weight gradients if asked


def rnn_flop_formulas() -> dict:
    """FlopCounterMode's custom_mapping for the cuDNN RNN ops: per counter, so nothing else in the
    process (another FlopCounterMode user) sees them, unlike torch's global register_flop_formula."""
    aten = torch.ops.aten
    return {aten._cudnn_rnn: cudnn_rnn_flop, aten._cudnn_rnn_backward: cudnn_rnn_backward_flop}
