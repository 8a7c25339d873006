"""LAViTeR's ITM (vldist.models.transformer_captioner): a CATR-style captioner under the step protocol."""

import pytest
import torch
from helpers import decoder_batch, fit_captions, stepwise_logits

from vldist.models.common import sinusoidal_positions
from vldist.models.generation import generate
from vldist.models.transformer_captioner import TransformerCaptioner

PAD, START, END = 0, 1, 2
VOCAB, FEATURES = 12, 6


def _model(dropout=0.0, max_len=16):
    return TransformerCaptioner(
        VOCAB,
        FEATURES,
        d_model=32,
        heads=2,
        encoder_layers=1,
        decoder_layers=1,
        feedforward=64,
        dropout=dropout,
        max_len=max_len,
    )


def _batch(batch=3, regions=4, seed=0):
    return decoder_batch(VOCAB, FEATURES, batch, regions, seed)


def _stepwise(decoder, features, mask, tokens):
    return stepwise_logits(decoder, features, mask, tokens)


def test_sinusoidal_positions():
    table = sinusoidal_positions(5, 8)
    assert table.shape == (5, 8)
    assert torch.equal(table[0, 0::2], torch.zeros(4)) and torch.equal(table[0, 1::2], torch.ones(4))
    three = torch.tensor(3.0)
    assert torch.allclose(table[3, 0], torch.sin(three)) and torch.allclose(table[3, 1], torch.cos(three))


@pytest.mark.parametrize("layers", [1, 2])
def test_teacher_forcing_equals_stepping(layers):
    torch.manual_seed(0)
    decoder = TransformerCaptioner(
        VOCAB, FEATURES, d_model=32, heads=2, encoder_layers=layers, decoder_layers=layers, feedforward=64, dropout=0.5
    ).eval()
    features, mask, tokens = _batch()
    forward = decoder(features, mask, tokens)
    assert forward.shape == (3, 5, VOCAB)
    stepped, state = _stepwise(decoder, features, mask, tokens)
    torch.testing.assert_close(forward, stepped, atol=1e-5, rtol=1e-5)
    # The state: batch-first, the words read so far.
    assert state["memory"].shape == (3, 4, 32) and torch.equal(state["mask"], mask)
    assert torch.equal(state["words"], tokens[:, :-1])


def test_init_state_is_batch_first_and_starts_empty():
    decoder = _model().eval()
    features, mask, _ = _batch()
    state = decoder.init_state(features, mask)
    assert state["words"].shape == (3, 0) and state["words"].dtype == torch.long
    assert all(value.shape[0] == 3 for value in state.values())
    # Beam search's reorder: index_select on dim 0 of every tensor.
    index = torch.tensor([2, 2, 0])
    reordered = {name: value.index_select(0, index) for name, value in state.items()}
    logits, _ = decoder.step(torch.full((3,), START), reordered)
    single, _ = decoder.step(torch.full((1,), START), decoder.init_state(features[2:], mask[2:]))
    torch.testing.assert_close(logits[0], single[0], atol=1e-5, rtol=1e-5)


def test_target_padding_changes_no_real_position():
    torch.manual_seed(0)
    decoder = _model().eval()
    features, mask, tokens = _batch()
    logits = decoder(features, mask, tokens)
    longer = torch.cat([tokens, torch.full((3, 3), PAD)], dim=1)  # more padding after every caption
    torch.testing.assert_close(decoder(features, mask, longer)[:, :5], logits, atol=1e-5, rtol=1e-5)
    # Row 0 ends at position 3: alone and unpadded it gives the same logits at its real positions.
    alone = decoder(features[:1], mask[:1], tokens[:1, :4])
    torch.testing.assert_close(alone, logits[:1, :3], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(logits).all()


def test_captions_longer_than_max_len_are_refused():
    decoder = _model(max_len=4).eval()
    features, mask, tokens = _batch()
    with pytest.raises(ValueError, match="max_len"):
        decoder(features, mask, tokens)
    assert decoder(features, mask, tokens[:, :5]).shape == (3, 4, VOCAB)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_generate_runs_greedy_and_beam(beam_size):
    torch.manual_seed(0)
    decoder = _model(dropout=0.1).train()
    features, mask, _ = _batch()
    out = generate(decoder, features, mask, START, END, max_len=7, beam_size=beam_size)
    assert decoder.training
    assert out.dtype == torch.long and out.dim() == 2 and out.shape[0] == 3 and 1 <= out.shape[1] <= 7
    assert ((out >= 0) & (out < VOCAB)).all() and START not in out.tolist()
    # A batch decodes as each image alone (the state is reordered correctly along dim 0).
    for i in range(3):
        single = generate(decoder, features[i : i + 1], mask[i : i + 1], START, END, max_len=7, beam_size=beam_size)[0]
        assert out[i, : len(single)].tolist() == single.tolist() and (out[i, len(single) :] == PAD).all()


def test_a_tiny_model_learns_captions_and_generates_them_back():
    torch.manual_seed(0)
    decoder = _model(dropout=0.1)
    features = torch.randn(2, 3, FEATURES)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    tokens = torch.tensor(
        [
            [START, 3, 4, 5, 6, END],
            [START, 7, 8, END, PAD, PAD],
        ]
    )
    loss = fit_captions(decoder, features, mask, tokens, lr=3e-3, steps=100)
    assert loss < 0.05, loss
    for beam_size in (1, 3):
        generated = generate(decoder, features, mask, START, END, max_len=8, beam_size=beam_size)
        assert decoder.training
        assert generated.tolist() == tokens[:, 1:].tolist(), beam_size
