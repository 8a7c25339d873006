"""VSRN's written-out teacher-forced loop (models/attention_gru_loop.py) against the autograd
decoder stepping token by token: values and every gradient in float64, over ragged captions and
padded regions, and the hand-written backward against finite differences."""

import pytest
import torch
from helpers import decoder_batch, stepwise_logits

from vldist.models import attention_gru_loop
from vldist.models.attention_gru_loop import _AttentionGRULoop, takes_written_out_path
from vldist.models.caption_decoder import AttentionCaptionDecoder

PAD, END, VOCAB, FEATURES = 0, 2, 12, 6


def _ragged_batch(batch=5):
    features, mask, tokens = decoder_batch(VOCAB, FEATURES, batch=batch, regions=4, seed=3)
    tokens[3, 2], tokens[3, 3:] = END, PAD
    tokens[4, 1:] = PAD  # only <start>: this row never runs
    return features.double(), mask, tokens


def test_the_written_out_loop_equals_stepping_in_float64_with_every_gradient(monkeypatch):
    torch.manual_seed(0)
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=5, hidden=7, dropout=0.0).double()
    features, mask, tokens = _ragged_batch()
    words = tokens[:, 1:] != PAD
    calls = []
    monkeypatch.setattr(
        _AttentionGRULoop, "apply", lambda *a, original=_AttentionGRULoop.apply: calls.append(1) or original(*a)
    )

    def run(fn):
        decoder.zero_grad()
        inputs = features.clone().requires_grad_()
        logits = fn(inputs)
        weights = torch.linspace(-1.0, 1.0, logits.numel(), dtype=logits.dtype).view_as(logits) * words[..., None]
        (logits * weights).sum().backward()
        grads = {name: p.grad.clone() for name, p in decoder.named_parameters()}
        return logits.detach(), {**grads, "features": inputs.grad}

    assert takes_written_out_path(decoder, features)
    logits, grads = run(lambda f: decoder(f, mask, tokens))
    assert calls  # the written-out loop ran
    reference, reference_grads = run(lambda f: stepwise_logits(decoder, f, mask, tokens)[0])
    torch.testing.assert_close(logits[words], reference[words], rtol=1e-10, atol=1e-12)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_the_hand_written_backward_matches_finite_differences():
    torch.manual_seed(1)
    rows, steps, word_dim, hidden, att, feat, regions = 3, 4, 3, 4, 5, 2, 3
    running = [3, 2, 2, 1]

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    padding = torch.tensor([[False, False, True], [False, False, False], [False, True, True]])
    tensors = (leaf(rows, steps, word_dim), leaf(rows, hidden), leaf(rows, regions, att), leaf(rows, regions, feat))
    weights = (
        leaf(att, hidden),
        leaf(att),
        leaf(1, att),
        leaf(1),
        leaf(3 * hidden, word_dim + feat),
        leaf(3 * hidden, hidden),
        leaf(3 * hidden),
        leaf(3 * hidden),
    )

    def loop(words, h, keys, features, *w):
        return _AttentionGRULoop.apply(words, h, keys, features, padding, running, *w)

    assert torch.autograd.gradcheck(loop, (*tensors, *weights))


def test_the_autograd_loop_stays_where_the_written_out_one_does_not_apply():
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=5, hidden=7)
    features = torch.randn(2, 3, FEATURES)
    assert takes_written_out_path(decoder, features)
    assert not takes_written_out_path(decoder, features.half())
    decoder.checkpoint_steps = True  # activation checkpointing recomputes each autograd step
    assert not takes_written_out_path(decoder.train(), features)
    assert takes_written_out_path(decoder.eval(), features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_written_out_path(decoder, features)
    decoder.cell.weight_ih.ds_id = 0  # ZeRO-3 gathers it only in the cell's own hooks
    assert not takes_written_out_path(decoder, features)


@pytest.mark.parametrize("running", [[0, 0], []])
def test_a_loop_that_runs_no_row_gives_zero_states(running):
    decoder = AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=5, hidden=7)
    words = torch.randn(2, len(running), 5)
    keys, features = torch.randn(2, 3, 7), torch.randn(2, 3, FEATURES)
    out = attention_gru_loop.attention_gru_hidden(
        decoder, words, torch.randn(2, 7), keys, features, torch.zeros(2, 3, dtype=torch.bool), running
    )
    assert out.shape == (len(running), 2, 7) and not out.any()
