"""Small tensor helpers shared by the models."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from vldist.models.gru_last_state import last_hidden_state, takes_written_out_path


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp(min=eps)


def length_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) True at each sequence's first lengths[b] positions (its real tokens)."""
    return torch.arange(length, device=lengths.device)[None] < lengths[:, None]


def all_real(features: torch.Tensor) -> torch.Tensor:
    """The region mask (B, R) of features (B, R, F) without padding: a CNN grid's or a node set's."""
    return features.new_ones(features.shape[:2], dtype=torch.bool)


def sinusoidal_positions(length: int, dim: int, device=None, dtype=None) -> torch.Tensor:
    """The (length, dim) sinusoidal encodings of Vaswani et al.: sin on even, cos on odd channels."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
    return table if dtype is None else table.to(dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of (B, K, D) using only rows where mask (B, K) is True."""
    weights = mask.to(x.dtype).unsqueeze(-1)
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def last_hidden_gru(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The GRU's hidden state after the last valid step of each sequence (B, hidden), padding never
    read. Lengths on the host: packed; on the CPU in fp32 by the written-out GRU of
    models/gru_last_state.py (the same recurrence, a faster backward). Lengths on an accelerator:
    packing would need them copied to the host, a sync that stalls the launch queue at every call,
    so the GRU runs over the padded batch instead (equal up to rounding).

    Compiled code calls it eagerly (dynamo does not trace nn.GRU, and packed batch sizes are
    data-dependent shapes: traced, every new set of lengths would recompile), one clean graph
    break, and compiled and eager steps run the same recurrence."""
    if torch.compiler.is_compiling():
        return _eager_last_hidden_gru()(gru, x, lengths)
    return _last_hidden_gru(gru, x, lengths)


@functools.cache
def _eager_last_hidden_gru():
    # made at the first compiled call: importing torch._dynamo at import time would load it for
    # `--help` too (tests/unit/test_help_imports.py)
    return torch.compiler.disable(_last_hidden_gru)


def _last_hidden_gru(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    if lengths.device.type == "cpu":
        if takes_written_out_path(gru, x):
            return last_hidden_state(gru, x, lengths)
        return last_hidden_packed(gru, x, lengths)
    return last_hidden_padded(gru, x, lengths)


def last_hidden_packed(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    _, hidden = gru(packed)
    return hidden[-1]


def last_hidden_padded(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The output at each sequence's last valid step of the GRU run over the padded batch: a
    forward recurrence never carries padding backwards, so that is the state after its real steps."""
    if gru.bidirectional or not gru.batch_first:
        raise ValueError("last_hidden_padded takes a batch-first, one-directional GRU")
    outputs, _ = gru(x)
    last = (lengths.to(device=outputs.device, dtype=torch.long) - 1)[:, None, None]
    return outputs.gather(1, last.expand(-1, 1, outputs.shape[-1])).squeeze(1)


def xavier_linear(layer: nn.Linear) -> nn.Linear:
    """VSE++/VSRN's init of the region projection: uniform Xavier weights, zero bias."""
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def checkpointed_step(module: nn.Module, step, *args) -> torch.Tensor:
    """`step(*args)`, one step of `module`'s unrolled loop: recomputed in the backward instead of
    keeping its activations when train.activation_checkpointing set `module.checkpoint_steps`
    (training/activation_checkpointing.py) and the module trains with gradient."""
    if module.checkpoint_steps and module.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(step, *args, use_reentrant=False)
    return step(*args)
