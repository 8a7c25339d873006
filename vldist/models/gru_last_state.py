"""The last hidden state of a one-layer GRU over packed sequences, with a hand-written backward.

On the CPU torch runs nn.GRU as one autograd node per operator and step: every step's backward
computes its own weight gradient (h_{t-1}^T x gate gradient, a thin GEMM: 18 ms for 1.6 GMAC at
VSRN's paper sizes, a third of a large GEMM's rate), and the packed input's per-step slices each
zero-fill a gradient buffer as large as the whole input (1.3 s of a 13 s paper-size step; 26 ms of
a 174 ms demo step). No library offers a CPU GRU that does otherwise (cuDNN's is CUDA-only), so
this one is written out: the forward runs the recurrence without autograd and keeps each step's
gates; the backward runs it in reverse for the hidden-state gradients only, then computes both
weight gradients and the input gradient as three large GEMMs over every step at once.

The recurrence is nn.GRU's (gates in its r, z, n order; `n` sees r * (W_hn h + b_hn)):

    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
    z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

`last_hidden_state` returns what nn.GRU's final hidden state over the same packed batch is (equal
up to rounding: tests/unit/test_gru_last_state.py checks values and every gradient in float64).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import pack_padded_sequence

from vldist.distributed.zero import partitioned


def takes_written_out_path(gru: nn.GRU, x: torch.Tensor) -> bool:
    """Whether `last_hidden_state` runs this GRU: CPU, one layer, one direction, biases, batch first,
    fp32/fp64 outside autocast and torch.compile (which traces nn.GRU's own decomposition), and
    not under ZeRO-3."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and gru.weight_ih_l0.dtype == x.dtype
        and gru.num_layers == 1
        and not gru.bidirectional
        and gru.bias
        and gru.batch_first
        and gru.proj_size == 0
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not partitioned(gru.parameters())
    )


def last_hidden_state(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, hidden): the state after each sequence's last valid step of x (B, T, F), lengths on the host."""
    packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    hidden = _PackedGRULastState.apply(
        packed.data, packed.batch_sizes, gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0, gru.bias_hh_l0
    )
    return hidden[packed.unsorted_indices]


class _PackedGRULastState(torch.autograd.Function):
    """data (N, F) time-major packed rows, batch_sizes (T,) -> (B, H) last states in sorted order."""

    @staticmethod
    def forward(ctx, data, batch_sizes, w_ih, w_hh, b_ih, b_hh):
        sizes = batch_sizes.tolist()
        hidden = w_hh.shape[1]
        input_gates = torch.addmm(b_ih, data, w_ih.t())  # every step's input side: one GEMM
        last = data.new_empty(sizes[0], hidden)  # each sequence's state after its last step
        h = data.new_zeros(sizes[0], hidden)
        previous, r_steps, z_steps, n_steps, hn_steps = [], [], [], [], []
        start = 0
        for step, n in enumerate(sizes):
            h_prev = h[:n]  # sorted longest first: the first n sequences are still running
            gi = input_gates[start : start + n]
            gh = torch.addmm(b_hh, h_prev, w_hh.t())
            r = torch.sigmoid(gi[:, :hidden] + gh[:, :hidden])
            z = torch.sigmoid(gi[:, hidden : 2 * hidden] + gh[:, hidden : 2 * hidden])
            hn = gh[:, 2 * hidden :]
            cand = torch.tanh(gi[:, 2 * hidden :] + r * hn)
            h = cand + z * (h_prev - cand)
            ending = sizes[step + 1] if step + 1 < len(sizes) else 0
            last[ending:n] = h[ending:]
            previous.append(h_prev)
            r_steps.append(r)
            z_steps.append(z)
            n_steps.append(cand)
            hn_steps.append(hn)
            start += n
        ctx.sizes = sizes
        ctx.save_for_backward(
            data,
            w_ih,
            w_hh,
            torch.cat(previous),
            torch.cat(r_steps),
            torch.cat(z_steps),
            torch.cat(n_steps),
            torch.cat(hn_steps),
        )
        return last

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h):
        data, w_ih, w_hh, previous, r, z, cand, hn = ctx.saved_tensors
        sizes, hidden = ctx.sizes, w_hh.shape[1]
        grad_input_gates = data.new_empty(data.shape[0], 3 * hidden)
        grad_hidden_gates = data.new_empty(data.shape[0], 3 * hidden)
        dh = grad_h.contiguous().clone()
        end = data.shape[0]
        for n in reversed(sizes):
            rows = slice(end - n, end)
            d = dh[:n]
            r_t, z_t, cand_t, hn_t = r[rows], z[rows], cand[rows], hn[rows]
            d_cand = d * (1 - z_t) * (1 - cand_t * cand_t)  # through tanh
            d_z = d * (previous[rows] - cand_t) * z_t * (1 - z_t)  # through sigmoid
            d_r = d_cand * hn_t * r_t * (1 - r_t)
            gi, gh = grad_input_gates[rows], grad_hidden_gates[rows]
            gi[:, :hidden], gi[:, hidden : 2 * hidden], gi[:, 2 * hidden :] = d_r, d_z, d_cand
            gh[:, : 2 * hidden] = gi[:, : 2 * hidden]
            gh[:, 2 * hidden :] = d_cand * r_t
            dh[:n] = d * z_t + gh @ w_hh  # the state's own path, and through the hidden-side gates
            end -= n
        needs = ctx.needs_input_grad
        grad_data = grad_input_gates @ w_ih if needs[0] else None
        grad_w_ih = grad_input_gates.t() @ data if needs[2] else None
        grad_w_hh = grad_hidden_gates.t() @ previous if needs[3] else None
        grad_b_ih = grad_input_gates.sum(0) if needs[4] else None
        grad_b_hh = grad_hidden_gates.sum(0) if needs[5] else None
        return grad_data, None, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh
