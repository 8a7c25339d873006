"""The ranking losses compute in float32 at least (losses/precision.py, `in_loss_precision`): under
bf16 autocast, or given bf16 embeddings, the VSE++ hinge and the two-branch losses return float32
values equal to the same formulas over the embeddings' values in float64, and the gradients come
back in the embeddings' own dtype. (The caption losses' precision: test_damsm_loss.py and the
recipes' `.float()` calls.)"""

import torch
import torch.nn.functional as F
from test_two_branch_loss import batch, direct_loss

from vldist.losses import cross_rank_vse_hinge_loss
from vldist.losses.hinge import vse_hinge_loss
from vldist.losses.two_branch import cross_rank_two_branch_ranking_loss, phrase_ranking_loss


def bf16(*xs):
    return [x.to(torch.bfloat16).requires_grad_() for x in xs]


def direct_vse_hinge(img, txt, margin):
    """VSE++'s max-violation hinge, row by row: each query's hardest negative in either direction."""
    total = 0.0
    n = img.shape[0]
    for i in range(n):
        positive = float(img[i] @ txt[i])
        total += max(max(0.0, margin + float(img[i] @ txt[j]) - positive) for j in range(n) if j != i)
        total += max(max(0.0, margin + float(txt[i] @ img[j]) - positive) for j in range(n) if j != i)
    return total


def test_the_vse_hinge_of_bf16_embeddings_is_float32_and_the_formula_of_their_values():
    g = torch.Generator().manual_seed(0)
    img, txt = (F.normalize(torch.randn(24, 16, generator=g), dim=1) for _ in range(2))
    low_img, low_txt = bf16(img, txt)
    for loss in (vse_hinge_loss, cross_rank_vse_hinge_loss):
        got = loss(low_img, low_txt, margin=0.2)
        assert got.dtype == torch.float32
        expected = direct_vse_hinge(low_img.detach().double(), low_txt.detach().double(), 0.2)
        assert abs(float(got) - expected) <= 1e-5 * expected
    got.backward()
    assert low_img.grad.dtype == torch.bfloat16 and low_img.grad.abs().sum() > 0


def test_the_vse_hinge_under_autocast_is_the_loss_outside_it():
    g = torch.Generator().manual_seed(1)
    img, txt = (F.normalize(torch.randn(32, 64, generator=g), dim=1) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = cross_rank_vse_hinge_loss(img, txt)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, cross_rank_vse_hinge_loss(img, txt), rtol=1e-6, atol=1e-6)


def test_the_two_branch_loss_of_bf16_embeddings_is_float32_and_the_papers_formula_of_their_values():
    image, text, text_image = batch(n_images=6, seed=3, dim=8)
    low_image, low_text = bf16(image, text)
    got = cross_rank_two_branch_ranking_loss(low_image, low_text, text_image, 0.1, 3, 1.0, 2.0, 0.2)
    assert got.dtype == torch.float32
    expected = direct_loss(low_image.detach().double(), low_text.detach().double(), text_image, 0.1, 3, 1.0, 2.0, 0.2)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    got.backward()
    assert low_text.grad.dtype == torch.bfloat16 and low_text.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = cross_rank_two_branch_ranking_loss(image.float(), text.float(), text_image)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, cross_rank_two_branch_ranking_loss(image.float(), text.float(), text_image))


def test_the_phrase_loss_under_autocast_is_the_loss_outside_it():
    """Two images of four regions and two phrases each; each phrase's positive is a region of its
    image, the image's other regions its negatives, and the image's other phrase a negative of its
    positive region."""
    g = torch.Generator().manual_seed(2)
    region = F.normalize(torch.randn(8, 32, generator=g), dim=1)
    phrase = F.normalize(region[[0, 5]].repeat_interleave(2, 0) + 0.5 * torch.randn(4, 32, generator=g), dim=1)
    positive = torch.tensor([0, 1, 4, 5])
    phrase_sample, region_sample = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    region_negatives = torch.tensor(
        [[m, r] for m in range(4) for r in range(8) if region_sample[r] == phrase_sample[m] and r != positive[m]]
    ).T
    phrase_negatives = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]]).T
    args = (positive, phrase_sample, region_sample, region_negatives, phrase_negatives)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = phrase_ranking_loss(region, phrase, *args, top_k=2)
    outside = phrase_ranking_loss(region, phrase, *args, top_k=2)
    assert under.dtype == torch.float32 and outside > 0
    torch.testing.assert_close(under, outside, rtol=1e-6, atol=1e-6)
    low_region, low_phrase = bf16(region, phrase)
    got = phrase_ranking_loss(low_region, low_phrase, *args, top_k=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, phrase_ranking_loss(low_region.float(), low_phrase.float(), *args, top_k=2))
