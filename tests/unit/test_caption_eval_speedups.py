"""The captioner evaluation's faster paths give what the straightforward computation gives.

caption_image_logprobs (captions stepped once per distinct prefix, per-image and per-token input
projections, logsumexp) against each pair stepped alone through `step` with a full log-softmax.
"""

import copy
import functools

import pytest
import torch
from torch import nn

from vldist.metrics import self_retrieval_recall
from vldist.metrics.self_retrieval import self_retrieval_ranks
from vldist.models.caption_scoring import (
    StepsOverPairs,
    caption_image_logprobs,
    own_image_logprobs,
    pair_scorer,
    self_retrieval_logprobs,
)
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder, lstm_update
from vldist.models.generation import generate

DECODERS = [AdaptiveAttentionDecoder, ShowTellDecoder]


@torch.no_grad()
def _pair_by_pair(decoder, features, mask, tokens, pad_id=0):
    """ln p(tokens[c] | image n): each pair alone, `step` by `step`, log_softmax over the vocabulary."""
    out = torch.zeros(tokens.shape[0], features.shape[0])
    for c in range(tokens.shape[0]):
        for n in range(features.shape[0]):
            state = decoder.init_state(features[n : n + 1], mask[n : n + 1])
            for t in range(tokens.shape[1] - 1):
                target = int(tokens[c, t + 1])
                if target == pad_id:
                    break
                logits, state = decoder.step(tokens[c, t : t + 1], state)
                out[c, n] += float(logits.log_softmax(dim=-1)[0, target])
    return out


class _StepOnly(nn.Module):
    """A decoder with only the step protocol: caption_image_logprobs falls back to StepsOverPairs."""

    def __init__(self, decoder):
        super().__init__()
        self.inner = decoder

    def init_state(self, features, mask):
        return self.inner.init_state(features, mask)

    def step(self, words, state):
        return self.inner.step(words, state)


def _inputs(seed=0, n_images=4, regions=3, feature_dim=6):
    torch.manual_seed(seed)
    features = torch.randn(n_images, regions, feature_dim)
    mask = torch.ones(n_images, regions, dtype=torch.bool)
    mask[1, 2:] = False
    mask[2, 1:] = False
    # <start>=1, <end>=2, padding 0; lengths deliberately out of order (the scorer sorts them),
    # one caption of <start> alone (ln p of nothing: 0)
    tokens = torch.tensor(
        [
            [1, 4, 2, 0, 0, 0],
            [1, 5, 6, 7, 8, 2],
            [1, 0, 0, 0, 0, 0],
            [1, 9, 10, 2, 0, 0],
            [1, 3, 11, 5, 2, 0],
        ]
    )
    return features, mask, tokens


def _decoder(decoder_class, seed=1):
    torch.manual_seed(seed)
    return decoder_class(vocab_size=12, feature_dim=6, hidden=16, embed=8, dropout=0.5).eval()


def _counting_rows(decoder) -> list[int]:
    """Patch the decoder's pair_step to record images x prefixes of each step."""
    rows, step = [], decoder.pair_step

    def counted(words, images, carry):
        logits, state = step(words, images, carry)
        rows.append(logits.shape[0] * logits.shape[1])
        return logits, state

    decoder.pair_step = counted
    return rows


@pytest.mark.parametrize("decoder_class", DECODERS)
@pytest.mark.parametrize("pairs_per_chunk", [1, 9, 10_000])  # a caption per group, 2 per group, all in one
def test_pair_scoring_equals_each_pair_stepped_alone(decoder_class, pairs_per_chunk):
    decoder = _decoder(decoder_class)
    features, mask, tokens = _inputs()
    assert hasattr(pair_scorer(decoder), "pair_words") and pair_scorer(decoder) is decoder
    matrix = caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=pairs_per_chunk)
    expected = _pair_by_pair(decoder, features, mask, tokens)
    assert matrix.shape == (5, 4) and matrix.dtype == torch.float32
    torch.testing.assert_close(matrix, expected, atol=1e-5, rtol=1e-5)
    assert (matrix[2] == 0).all() and (matrix[[0, 1, 3, 4]] < 0).all()


@pytest.mark.parametrize("decoder_class", DECODERS)
def test_the_step_fallback_equals_each_pair_stepped_alone(decoder_class):
    decoder = _StepOnly(_decoder(decoder_class)).eval()
    features, mask, tokens = _inputs(seed=2)
    assert isinstance(pair_scorer(decoder), StepsOverPairs)
    matrix = caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=9)
    torch.testing.assert_close(matrix, _pair_by_pair(decoder, features, mask, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decoder_class", DECODERS)
@pytest.mark.parametrize("pairs_per_chunk", [1, 7, 10_000])  # an image a block (widest depth: 2), 3 a block, all
def test_captions_that_begin_alike_are_stepped_once_per_image_and_score_as_alone(decoder_class, pairs_per_chunk):
    """Beam search repeats itself: shared prefixes, a caption twice, one that ends where another
    goes on, one of <start> alone. Each image steps each distinct prefix that predicts a word once."""
    decoder = _decoder(decoder_class)
    features, mask, _ = _inputs(seed=4)
    tokens = torch.tensor(
        [
            [1, 4, 5, 6, 2, 0],
            [1, 4, 5, 7, 8, 2],
            [1, 4, 5, 6, 2, 0],  # the first again
            [1, 4, 5, 2, 0, 0],  # ends where the others go on
            [1, 9, 2, 0, 0, 0],
            [1, 0, 0, 0, 0, 0],
            [1, 4, 5, 6, 3, 2],
        ]
    )
    rows = _counting_rows(decoder)
    matrix = caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=pairs_per_chunk)
    torch.testing.assert_close(matrix, _pair_by_pair(decoder, features, mask, tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(matrix[2], matrix[0], atol=0, rtol=0)
    prefixes = {tuple(row[: t + 1]) for row in tokens.tolist() for t in range(len(row) - 1) if row[t + 1] != 0}
    assert len(prefixes) == 8  # against 23 steps caption by caption
    assert sum(rows) == len(prefixes) * features.shape[0]


@pytest.mark.parametrize("decoder_class", DECODERS)
@pytest.mark.parametrize("pairs_per_chunk", [1, 10_000])  # an image a block, all in one
def test_a_floor_drops_only_pairs_that_end_below_it(decoder_class, pairs_per_chunk):
    decoder = _decoder(decoder_class)
    features, mask, tokens = _inputs(seed=5)
    exact = _pair_by_pair(decoder, features, mask, tokens)
    # a word costs about ln 12 here: a floor 3 above the median final is passed before the last word by half the images
    floor = exact.median(dim=1).values + 3
    rows = _counting_rows(decoder)
    matrix = caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=pairs_per_chunk, floor=floor)
    dropped = matrix == float("-inf")
    assert dropped.any()
    assert (exact[dropped] < floor[:, None].expand_as(exact)[dropped]).all()
    torch.testing.assert_close(matrix[~dropped], exact[~dropped], atol=1e-5, rtol=1e-5)
    pruned_rows = sum(rows)
    rows.clear()
    caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=pairs_per_chunk)
    assert pruned_rows < sum(rows)  # dropped prefixes were not stepped
    # no floor reached: nothing dropped
    low = caption_image_logprobs(
        decoder, features, mask, tokens, pairs_per_chunk=pairs_per_chunk, floor=exact.min(1).values - 1
    )
    torch.testing.assert_close(low, exact, atol=1e-5, rtol=1e-5)


@functools.cache
def _trained_decoder(decoder_class, n_images: int):
    """A tiny decoder taught one caption per image (a few hundred Adam steps of teacher forcing), so
    that, as after training, a caption scores far higher on its own image than on the others."""
    torch.manual_seed(7)
    decoder = decoder_class(vocab_size=12, feature_dim=6, hidden=16, embed=8, dropout=0.0)
    features = torch.randn(n_images, 3, 6)
    mask = torch.ones(n_images, 3, dtype=torch.bool)
    mask[::3, 2] = False
    taught = torch.cat([torch.ones(n_images, 1, dtype=torch.long), torch.randint(3, 12, (n_images, 4))], dim=1)
    taught = torch.cat([taught, torch.full((n_images, 1), 2)], dim=1)  # <start> 4 words <end>
    optimizer = torch.optim.Adam(decoder.parameters(), lr=0.02)
    for _ in range(300):
        logits = decoder(features, mask, taught)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 12), taught[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return decoder.eval(), features, mask


@pytest.mark.parametrize("decoder_class", DECODERS)
@pytest.mark.parametrize("beam_size", [1, 3])
def test_self_retrieval_scoring_keeps_every_rank_and_steps_less(decoder_class, beam_size):
    """Captions generated from their images, as the captioner's evaluation does: the matrix with
    the pairs that cannot outscore a caption's own image dropped gives every caption the rank the
    whole matrix gives it, and steps fewer prefixes."""
    n = 10
    decoder, features, mask = _trained_decoder(decoder_class, n)
    decoder = copy.deepcopy(decoder)  # the cached one stays unpatched
    ids = generate(decoder, features, mask, start_id=1, end_id=2, max_len=6, beam_size=beam_size)
    tokens = torch.cat([torch.ones(n, 1, dtype=torch.long), ids], dim=1)
    after_end = (tokens == 2).long().cumsum(1) - (tokens == 2).long()
    tokens = tokens.masked_fill(after_end > 0, 0)  # padding after each caption's end, as the evaluation trims
    exact = _pair_by_pair(decoder, features, mask, tokens)
    torch.testing.assert_close(own_image_logprobs(decoder, features, mask, tokens), exact.diag(), atol=1e-5, rtol=1e-5)
    rows = _counting_rows(decoder)
    matrix = self_retrieval_logprobs(decoder, features, mask, tokens, pairs_per_chunk=30)
    dropped = matrix == float("-inf")
    assert dropped.any() and not dropped.diag().any()
    assert (exact[dropped] < exact.diag()[:, None].expand_as(exact)[dropped]).all()
    torch.testing.assert_close(matrix[~dropped], exact[~dropped], atol=1e-5, rtol=1e-5)
    assert (self_retrieval_ranks(matrix) == self_retrieval_ranks(exact)).all()
    assert self_retrieval_recall(matrix, (1, 5)) == self_retrieval_recall(exact, (1, 5))
    pruned_rows = sum(rows)
    rows.clear()
    caption_image_logprobs(decoder, features, mask, tokens, pairs_per_chunk=30)
    assert pruned_rows < sum(rows)


@pytest.mark.parametrize("decoder_class", DECODERS)
def test_a_nan_score_is_not_dropped_but_shown(decoder_class):
    """An image whose features are NaN: its scores stay NaN in the matrix (so the recall's check
    refuses them) rather than being dropped as below the floors."""
    decoder, features, mask = _trained_decoder(decoder_class, 10)
    features = features.clone()
    features[0] = float("nan")
    ids = generate(decoder, features, mask, start_id=1, end_id=2, max_len=6, beam_size=1)
    tokens = torch.cat([torch.ones(10, 1, dtype=torch.long), ids], dim=1)
    matrix = self_retrieval_logprobs(decoder, features, mask, tokens)
    assert torch.isnan(matrix[:, 0]).all() and not torch.isnan(matrix[:, 1:]).any()
    with pytest.raises(ValueError, match="NaN"):
        self_retrieval_recall(matrix, (1, 5))


@pytest.mark.parametrize("decoder_class", DECODERS)
def test_no_captions_or_no_images(decoder_class):
    decoder = _decoder(decoder_class)
    features, mask, tokens = _inputs()
    assert caption_image_logprobs(decoder, features, mask, tokens[:0]).shape == (0, 4)
    assert caption_image_logprobs(decoder, features[:0], mask[:0], tokens).shape == (5, 0)


def test_lstm_update_is_torchs_lstm_cell():
    torch.manual_seed(3)
    cell = nn.LSTMCell(5, 7)
    x, h, c = torch.randn(4, 5), torch.randn(4, 7), torch.randn(4, 7)
    gates = nn.functional.linear(h, cell.weight_hh, cell.bias_hh) + nn.functional.linear(
        x, cell.weight_ih, cell.bias_ih
    )
    with torch.no_grad():
        expected = cell(x, (h, c))
        got = lstm_update(gates, c)
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)
