"""VSRN's teacher-forced attention-GRU loop on CPU, with a hand-written backward.

Under autograd each of the loop's steps records about 20 operators and runs about 40 in the
backward, each a few microseconds of dispatch and graph bookkeeping on tensors of a few hundred
kilobytes: at the demo's sizes the decoder's forward and backward took about half of VSRN's step,
and its GEMMs under half of the decoder's time. Neither torch nor a library offers this
recurrence fused (the attention feeds each step's input), and torch.compile takes minutes on a
2-core CPU, so it is written out as in `gru_last_state`: the forward runs without autograd and
keeps what the backward needs; the backward runs the steps in reverse for the state gradients
only, and computes the weight gradients, the word gradients and the region-feature gradient as
one GEMM each over all steps. The word half of the GRU's input gates is one GEMM over all steps
in the forward too. Steps run only the captions still predicting a word (`running_captions`).

One step, as `AttentionCaptionDecoder._advance` computes it (regions padded where `padding`):

    a = W_ah h + b_ah                          u_r = tanh(k_r + a)
    s_r = w_s . u_r + b_s                      alpha = softmax(s over the real regions)
    c = sum_r alpha_r v_r                      h' = GRUCell([word; c], h)

tests/unit/test_attention_gru_loop.py checks values and every gradient against the autograd loop
in float64 and the backward against finite differences.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from vldist.distributed.zero import partitioned


def takes_written_out_path(decoder: nn.Module, features: Tensor) -> bool:
    """CPU, fp32/fp64, outside autocast and torch.compile, not recomputing each step under
    activation checkpointing (which keeps the autograd loop), and not under ZeRO-3 (the loop reads
    its submodules' parameters without calling them)."""
    return (
        features.device.type == "cpu"
        and features.dtype in (torch.float32, torch.float64)
        and decoder.cell.weight_ih.dtype == features.dtype
        and decoder.cell.bias
        and not (decoder.checkpoint_steps and decoder.training and torch.is_grad_enabled())
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not partitioned(decoder.parameters())
    )


def attention_gru_hidden(
    decoder: nn.Module, words: Tensor, h: Tensor, keys: Tensor, features: Tensor, padding: Tensor, running: list[int]
) -> Tensor:
    """Hidden states (S, B, H) of the teacher-forced loop over `words` (B, S, W), rows in running
    order (step t runs the first running[t]; the others' states are zero)."""
    if not words.shape[1] or not running[0]:
        return h.new_zeros(words.shape[1], words.shape[0], h.shape[1])
    return _AttentionGRULoop.apply(
        words,
        h,
        keys,
        features,
        padding,
        running,
        decoder.att_hidden.weight,
        decoder.att_hidden.bias,
        decoder.att_score.weight,
        decoder.att_score.bias,
        decoder.cell.weight_ih,
        decoder.cell.weight_hh,
        decoder.cell.bias_ih,
        decoder.cell.bias_hh,
    )


class _AttentionGRULoop(torch.autograd.Function):
    """words (B, S, W), h (B, H), keys (B, R, A), features (B, R, F), padding (B, R), running
    (steps' row counts) and the decoder's weights -> hidden states (S, B, H), rows in running order."""

    @staticmethod
    def forward(ctx, words, h, keys, features, padding, running, w_ah, b_ah, w_s, b_s, w_ih, w_hh, b_ih, b_hh):
        rows, steps, word_dim = words.shape
        hidden = w_hh.shape[1]
        running = [n for n in running if n]  # non-increasing: the steps that run a row
        w_word, w_context = w_ih[:, :word_dim], w_ih[:, word_dim:]
        word_gates = torch.addmm(b_ih, words.reshape(rows * steps, word_dim), w_word.t()).view(rows, steps, -1)
        out = h.new_zeros(steps, rows, hidden)
        # what the backward reads, packed: step t's running rows after step t - 1's
        packed = sum(running)
        h_prev = h.new_empty(packed, hidden)
        u = h.new_empty(packed, *keys.shape[1:])
        alpha = h.new_empty(packed, keys.shape[1])
        context = h.new_empty(packed, features.shape[2])
        rz = h.new_empty(packed, 2 * hidden)
        cand = h.new_empty(packed, hidden)
        hn = h.new_empty(packed, hidden)
        lowest = torch.finfo(h.dtype).min
        start = 0
        for t, n in enumerate(running):
            at = slice(start, start + n)
            h_prev[at] = h[:n]
            u_t = torch.tanh(keys[:n] + torch.addmm(b_ah, h_prev[at], w_ah.t())[:, None, :], out=u[at])
            alpha[at] = torch.softmax((u_t @ w_s[0] + b_s).masked_fill(padding[:n], lowest), dim=-1)
            c_t = torch.bmm(alpha[at, None, :], features[:n], out=context[at, None, :]).squeeze(1)
            gi = torch.addmm(word_gates[:n, t], c_t, w_context.t())
            gh = torch.addmm(b_hh, h_prev[at], w_hh.t())
            rz_t = torch.sigmoid(gi[:, : 2 * hidden] + gh[:, : 2 * hidden], out=rz[at])
            hn[at] = gh[:, 2 * hidden :]
            cand_t = torch.tanh(torch.addcmul(gi[:, 2 * hidden :], rz_t[:, :hidden], hn[at]), out=cand[at])
            h = torch.addcmul(cand_t, rz_t[:, hidden:], h_prev[at] - cand_t)
            out[t, :n] = h
            start += n
        ctx.running = running
        ctx.padding = padding
        ctx.save_for_backward(words, keys, features, w_ah, w_s, w_ih, w_hh, h_prev, u, alpha, context, rz, cand, hn)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        words, keys, features, w_ah, w_s, w_ih, w_hh, h_prev, u, alpha, context, rz, cand, hn = ctx.saved_tensors
        running, padding = ctx.running, ctx.padding
        rows, steps, word_dim = words.shape
        hidden = w_hh.shape[1]
        w_context = w_ih[:, word_dim:]
        packed = h_prev.shape[0]
        grad_gi = h_prev.new_empty(packed, 3 * hidden)  # per packed row: the input-side gate gradients
        grad_gh = h_prev.new_empty(packed, 3 * hidden)
        grad_scores = h_prev.new_empty(packed, keys.shape[1])
        grad_a = h_prev.new_empty(packed, w_ah.shape[0])
        grad_context = h_prev.new_empty(packed, features.shape[2])
        grad_keys = torch.zeros_like(keys)
        dh = h_prev.new_zeros(rows, hidden)
        end = packed
        for t in reversed(range(len(running))):
            n = running[t]
            at = slice(end - n, end)
            d = dh[:n] + grad_out[t, :n]
            r_t, z_t, cand_t, hn_t = rz[at, :hidden], rz[at, hidden:], cand[at], hn[at]
            d_cand = d * (1 - z_t) * (1 - cand_t * cand_t)
            gi, gh = grad_gi[at], grad_gh[at]
            gi[:, hidden : 2 * hidden] = d * (h_prev[at] - cand_t) * z_t * (1 - z_t)
            gi[:, :hidden] = d_cand * hn_t * r_t * (1 - r_t)
            gi[:, 2 * hidden :] = d_cand
            gh[:, : 2 * hidden] = gi[:, : 2 * hidden]
            gh[:, 2 * hidden :] = d_cand * r_t
            d_context = torch.mm(gi, w_context, out=grad_context[at])
            # softmax backward: ds = alpha * (d_alpha - sum(alpha * d_alpha)); padded regions have alpha 0
            d_alpha = torch.bmm(features[:n], d_context[:, :, None]).squeeze(-1)
            alpha_t = alpha[at]
            ds = grad_scores[at]
            torch.mul(alpha_t, d_alpha - (alpha_t * d_alpha).sum(-1, keepdim=True), out=ds)
            ds.masked_fill_(padding[:n], 0)  # as masked_fill's backward (matters if a row has no real region)
            u_t = u[at]
            d_pre = (ds[:, :, None] * w_s[0]) * (1 - u_t * u_t)
            grad_keys[:n] += d_pre
            da = torch.sum(d_pre, dim=1, out=grad_a[at])
            dh[:n] = d * z_t + torch.addmm(gh @ w_hh, da, w_ah)
            end -= n
        needs = ctx.needs_input_grad
        grad_words = _unpacked(grad_gi @ w_ih[:, :word_dim], running, rows, steps) if needs[0] else None
        grad_features = None
        if needs[3]:  # dV_b = sum_t alpha_{t,b}^T dc_{t,b}: one batched GEMM over the steps
            dense_alpha = _unpacked(alpha, running, rows, steps)  # (B, S, R)
            dense_context = _unpacked(grad_context, running, rows, steps)  # (B, S, F)
            grad_features = torch.bmm(dense_alpha.transpose(1, 2), dense_context)
        u_rows = u.reshape(-1, u.shape[-1])
        return (
            grad_words,
            dh if needs[1] else None,
            grad_keys if needs[2] else None,
            grad_features,
            None,
            None,
            grad_a.t() @ h_prev if needs[6] else None,
            grad_a.sum(0) if needs[7] else None,
            (grad_scores.reshape(1, -1) @ u_rows) if needs[8] else None,
            grad_scores.sum().reshape(1) if needs[9] else None,
            grad_gi.t() @ torch.cat([_packed(words, running), context], dim=1) if needs[10] else None,
            grad_gh.t() @ h_prev if needs[11] else None,
            grad_gi.sum(0) if needs[12] else None,
            grad_gh.sum(0) if needs[13] else None,
        )


def _packed(x: Tensor, running: list[int]) -> Tensor:
    """(B, S, ...) -> (sum(running), ...): step t's first running[t] rows, step after step."""
    return torch.cat([x[:n, t] for t, n in enumerate(running)])


def _unpacked(packed: Tensor, running: list[int], rows: int, steps: int) -> Tensor:
    """The inverse of `_packed`, zero where a row had stopped: (B, S, ...)."""
    dense = packed.new_zeros(rows, steps, *packed.shape[1:])
    start = 0
    for t, n in enumerate(running):
        dense[:n, t] = packed[start : start + n]
        start += n
    return dense
