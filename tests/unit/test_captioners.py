"""The CL base captioners (AdaptiveAttention, Neuraltalk2), VSRN's decoder and LAViTeR's transformer captioner
under the step protocol (the transformer's own tests: test_transformer_captioner.py)."""

import pytest
import torch
from helpers import decoder_batch, fit_captions, stepwise_logits

from vldist.models.caption_decoder import AttentionCaptionDecoder
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder
from vldist.models.generation import generate
from vldist.models.transformer_captioner import TransformerCaptioner

PAD, START, END = 0, 1, 2
VOCAB, FEATURES = 12, 6

DECODERS = {
    "adaptive": lambda dropout=0.0: AdaptiveAttentionDecoder(VOCAB, FEATURES, hidden=24, embed=16, dropout=dropout),
    "showtell": lambda dropout=0.0: ShowTellDecoder(VOCAB, FEATURES, hidden=24, embed=16, dropout=dropout),
    "vsrn": lambda dropout=0.0: AttentionCaptionDecoder(VOCAB, FEATURES, word_dim=16, hidden=24, dropout=dropout),
}
WITH_TRANSFORMER = {
    **DECODERS,
    "transformer": lambda dropout=0.0: TransformerCaptioner(
        VOCAB, FEATURES, d_model=32, heads=2, encoder_layers=1, decoder_layers=1, feedforward=64, dropout=dropout
    ),
}


def _batch(batch=3, regions=4, seed=0):
    return decoder_batch(VOCAB, FEATURES, batch, regions, seed)


def _stepwise(decoder, features, mask, tokens):
    return stepwise_logits(decoder, features, mask, tokens)[0]


@pytest.mark.parametrize("name", DECODERS)
def test_teacher_forcing_equals_stepping(name):
    torch.manual_seed(0)
    decoder = DECODERS[name](dropout=0.5).eval()
    features, mask, tokens = _batch()
    forward = decoder(features, mask, tokens)
    assert forward.shape == (3, 5, VOCAB)
    # where the target is a word: on CPU VSRN's decoder stops a caption at its last word
    words = tokens[:, 1:] != 0
    assert torch.allclose(forward[words], _stepwise(decoder, features, mask, tokens)[words], atol=1e-5)


@pytest.mark.parametrize("name", WITH_TRANSFORMER)
def test_padded_regions_change_nothing(name):
    torch.manual_seed(0)
    decoder = WITH_TRANSFORMER[name]().eval()
    features, mask, tokens = _batch()
    garbage = features.clone()
    garbage[~mask] = 1e3 * torch.randn(int((~mask).sum()), FEATURES)
    extra = torch.cat([garbage, 1e3 * torch.randn(3, 2, FEATURES)], dim=1)
    extra_mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], dim=1)
    expected = decoder(features, mask, tokens)
    assert torch.allclose(decoder(garbage, mask, tokens), expected, atol=1e-5)
    assert torch.allclose(decoder(extra, extra_mask, tokens), expected, atol=1e-5)
    # ... while a real region does change it.
    moved = features.clone()
    moved[:, 0] += 1.0
    assert not torch.allclose(decoder(moved, mask, tokens), expected)


def test_adaptive_attention_weights_and_the_sentinel():
    torch.manual_seed(0)
    decoder = DECODERS["adaptive"]().eval()
    features, mask, tokens = _batch()
    state = decoder.init_state(features, mask)
    for t in range(tokens.shape[1] - 1):
        _, state = decoder.step(tokens[:, t], state)
        attention = state["attention"]  # (B, R + 1): regions, then the sentinel's beta
        regions, beta = attention[:, :-1], attention[:, -1]
        assert attention.shape == (3, 5)
        assert torch.allclose(attention.sum(-1), torch.ones(3))
        assert ((beta >= 0) & (beta <= 1)).all() and (0 < beta).all() and (beta < 1).all()
        assert (regions[~mask] == 0).all()
        alpha = regions / (1 - beta[:, None])  # renormalised over the regions: the alpha of c_t
        assert torch.allclose(alpha.sum(-1), torch.ones(3), atol=1e-5)
    # With every region masked, only the sentinel is left to look at.
    _, state = decoder.step(tokens[:, 0], decoder.init_state(features, torch.zeros_like(mask)))
    assert torch.allclose(state["attention"][:, -1], torch.ones(3))


def test_show_tell_reads_the_image_before_start():
    torch.manual_seed(0)
    decoder = DECODERS["showtell"]().eval()
    features, mask, tokens = _batch()
    state = decoder.init_state(features, mask)
    assert state["h"].shape == (3, 24) and state["h"].abs().sum() > 0  # the image step has run
    other = decoder(features + 1.0, mask, tokens)
    assert not torch.allclose(other, decoder(features, mask, tokens))


@pytest.mark.parametrize("name", DECODERS)
def test_a_tiny_model_learns_captions_and_generates_them_back(name):
    torch.manual_seed(0)
    decoder = DECODERS[name](dropout=0.1)
    features = torch.randn(4, 3, FEATURES)
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    tokens = torch.tensor(
        [
            [START, 3, 4, 5, 6, END],
            [START, 7, 8, END, PAD, PAD],
            [START, 3, 9, 10, 11, END],
            [START, 11, END, PAD, PAD, PAD],
        ]
    )
    loss = fit_captions(decoder, features, mask, tokens, lr=1e-2, steps=400, stop_below=0.01)
    assert loss < 0.05, loss
    expected = tokens[:, 1:]
    for beam_size in (1, 3):
        generated = generate(decoder, features, mask, START, END, max_len=8, beam_size=beam_size)
        assert decoder.training  # the mode it was in
        assert generated.tolist() == expected.tolist(), beam_size
