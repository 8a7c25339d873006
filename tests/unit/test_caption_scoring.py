"""caption_image_logprobs: every caption against every image, each image encoded once."""

import pytest
import torch

from vldist.models.caption_scoring import caption_image_logprobs
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder


@torch.no_grad()
def _direct(decoder, features, mask, tokens):
    """ln p(caption c | image n) pair by pair through the teacher-forced forward, summed in python."""
    out = torch.empty(tokens.shape[0], features.shape[0])
    for c in range(tokens.shape[0]):
        for n in range(features.shape[0]):
            logp = decoder(features[n : n + 1], mask[n : n + 1], tokens[c : c + 1]).log_softmax(dim=-1)[0]
            out[c, n] = sum(float(logp[t, w]) for t, w in enumerate(tokens[c, 1:].tolist()) if w != 0)
    return out


@pytest.mark.parametrize("decoder_class", [AdaptiveAttentionDecoder, ShowTellDecoder])
@pytest.mark.parametrize("chunk", [3, 1000])
def test_the_matrix_equals_scoring_each_pair_alone(decoder_class, chunk):
    torch.manual_seed(0)
    decoder = decoder_class(vocab_size=12, feature_dim=6, hidden=16, embed=8, dropout=0.0).eval()
    features = torch.randn(4, 3, 6)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # <start> words <end>, of different lengths, padded with 0
    tokens = torch.tensor([[1, 5, 6, 7, 2], [1, 4, 2, 0, 0], [1, 9, 10, 2, 0]])
    matrix = caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=chunk)
    assert matrix.shape == (3, 4)
    torch.testing.assert_close(matrix, _direct(decoder, features, mask, tokens), atol=1e-5, rtol=1e-5)
