"""Negative captions for Contrastive Learning: never the caption's own image, every other image's
captions reachable with equal chance, a seeded and repeatable draw, and the clear errors."""

import pytest
import torch

from vldist.losses.negatives import draw_negatives, gather_captions


def layout(captions_per_image, seed, shuffle=True):
    """Image ids of the captions: image i (id 10*i + 3, not a position) has captions_per_image[i]
    captions; shuffled so an image's captions are not contiguous."""
    ids = torch.repeat_interleave(torch.arange(len(captions_per_image)) * 10 + 3, torch.tensor(captions_per_image))
    if shuffle:
        ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    return ids


LAYOUTS = {
    "two images, one caption each": [1, 1],
    "two images, uneven": [1, 4],
    "coco-like, 5 each": [5] * 6,
    "ragged": [1, 3, 5, 2, 7, 1, 1, 4],
    "one big image among small": [20, 1, 1, 2],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_negative_never_comes_from_the_captions_own_image(name):
    for seed in range(5):
        ids = layout(LAYOUTS[name], seed)
        draw = draw_negatives(ids, 200, torch.Generator().manual_seed(seed))
        assert draw.shape == (200, len(ids)) and draw.dtype == torch.long
        assert draw.min() >= 0 and draw.max() < len(ids)
        assert not (ids[draw] == ids[None, :]).any()


@pytest.mark.parametrize("name", ["two images, uneven", "ragged", "one big image among small"])
def test_every_caption_of_another_image_is_drawn_with_equal_chance(name):
    """Per positive t, the counts over its candidates (the captions of other images) are all
    non-zero and pass a chi-square bound for the uniform distribution (mean df, sd sqrt(2 df):
    the bound is 6 sd above the mean)."""
    ids = layout(LAYOUTS[name], seed=0)
    draws = 4000
    draw = draw_negatives(ids, draws, torch.Generator().manual_seed(7))
    for t in range(len(ids)):
        candidates = (ids != ids[t]).nonzero().flatten()
        counts = torch.bincount(draw[:, t], minlength=len(ids)).double()
        assert counts[ids == ids[t]].sum() == 0
        observed = counts[candidates]
        assert (observed > 0).all(), (t, observed)
        expected = draws / len(candidates)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        df = len(candidates) - 1
        assert chi2 <= df + 6 * (2 * max(df, 1)) ** 0.5, (t, chi2, df)


def test_the_draw_is_uniform_over_captions_not_images():
    """With captions 1 + 4 + 1, image 0's caption picks image 1 (4 captions) 4 times as often as image 2."""
    ids = torch.tensor([0, 1, 1, 1, 1, 2])
    draw = draw_negatives(ids, 20000, torch.Generator().manual_seed(3))
    share_of_image_1 = float((ids[draw[:, 0]] == 1).double().mean())
    assert share_of_image_1 == pytest.approx(0.8, abs=0.015)


def test_same_seed_same_draw_and_different_seed_or_step_a_different_one():
    ids = layout(LAYOUTS["ragged"], seed=1)
    a = draw_negatives(ids, 5, torch.Generator().manual_seed(42))
    assert torch.equal(a, draw_negatives(ids, 5, torch.Generator().manual_seed(42)))
    assert not torch.equal(a, draw_negatives(ids, 5, torch.Generator().manual_seed(43)))
    generator = torch.Generator().manual_seed(42)
    first, second = draw_negatives(ids, 5, generator), draw_negatives(ids, 5, generator)
    assert torch.equal(first, a) and not torch.equal(first, second)  # re-drawn each step
    assert not torch.equal(a[0], a[1])  # the K sets differ


def test_the_draw_depends_on_the_ids_not_on_their_device_or_integer_type():
    ids = layout(LAYOUTS["coco-like, 5 each"], seed=2)
    expected = draw_negatives(ids, 5, torch.Generator().manual_seed(0))
    assert torch.equal(draw_negatives(ids.int(), 5, torch.Generator().manual_seed(0)), expected)
    if torch.cuda.is_available():
        got = draw_negatives(ids.cuda(), 5, torch.Generator().manual_seed(0))
        assert got.is_cuda and torch.equal(got.cpu(), expected)


def test_all_captions_of_one_image_is_a_clear_error():
    with pytest.raises(ValueError, match="one image"):
        draw_negatives(torch.tensor([4, 4, 4]), 5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one image"):
        draw_negatives(torch.tensor([9]), 1, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "ids,k,error",
    [
        (torch.tensor([0, 1]), 0, ValueError),
        (torch.tensor([0, 1]), 2.0, ValueError),
        (torch.tensor([[0, 1]]), 1, ValueError),
        (torch.tensor([0.0, 1.0]), 1, TypeError),
        ([0, 1], 1, TypeError),
    ],
)
def test_bad_arguments(ids, k, error):
    with pytest.raises(error):
        draw_negatives(ids, k, torch.Generator().manual_seed(0))


def test_an_empty_batch_draws_nothing():
    assert draw_negatives(torch.zeros(0, dtype=torch.long), 3, torch.Generator()).shape == (3, 0)


def test_gather_captions_in_one_process_returns_its_inputs():
    tokens, lengths, ids = torch.randint(1, 9, (4, 6)), torch.tensor([6, 2, 3, 1]), torch.tensor([5, 5, 8, 1])
    out = gather_captions(tokens, lengths, ids)
    assert out[0] is tokens and out[1] is lengths and out[2] is ids and out[3] == 0
    with pytest.raises(ValueError, match="lengths"):
        gather_captions(tokens, lengths[:3], ids)
