"""VSE++ hinge loss against a brute-force double loop, its gradients, and the row-split property."""

import pytest
import torch
import torch.nn.functional as F

from vldist.losses import hardest_negative_hinge, vse_hinge_loss


def embeddings(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(b, d, generator=g, dtype=torch.float64, requires_grad=True)
    txt = torch.randn(b, d, generator=g, dtype=torch.float64, requires_grad=True)
    return img, txt


def bruteforce_vsepp(img, txt, margin, max_violation):
    """VSE++ ContrastiveLoss pair by pair: for each i, negatives j != i in both directions."""
    s = img @ txt.t()
    total = s.new_zeros(())
    for i in range(len(s)):
        cost_s = [torch.clamp(margin + s[i, j] - s[i, i], min=0) for j in range(len(s)) if j != i]
        cost_im = [torch.clamp(margin + s[j, i] - s[i, i], min=0) for j in range(len(s)) if j != i]
        if max_violation:
            total = total + torch.stack(cost_s).max() + torch.stack(cost_im).max()
        else:
            total = total + torch.stack(cost_s).sum() + torch.stack(cost_im).sum()
    return total


@pytest.mark.parametrize("max_violation", [True, False])
@pytest.mark.parametrize("margin", [0.0, 0.2, 0.5])
def test_matches_bruteforce_loss_and_grads(margin, max_violation):
    img_raw, txt_raw = embeddings(8, 16, seed=int(margin * 10) + max_violation)
    # Separate graphs from the raw embeddings, so each autograd.grad call owns its own.
    loss = vse_hinge_loss(F.normalize(img_raw, dim=1), F.normalize(txt_raw, dim=1), margin, max_violation)
    ref = bruteforce_vsepp(F.normalize(img_raw, dim=1), F.normalize(txt_raw, dim=1), margin, max_violation)
    assert loss.item() > 0  # random embeddings violate the margin, so the check is not 0 == 0
    torch.testing.assert_close(loss, ref)
    grads = torch.autograd.grad(loss, (img_raw, txt_raw))
    ref_grads = torch.autograd.grad(ref, (img_raw, txt_raw))
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, r)


def test_max_violation_is_smaller_than_sum_of_violations():
    img, txt = embeddings(8, 16, seed=7)
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    hardest = vse_hinge_loss(img, txt, max_violation=True)
    assert 0 < hardest < vse_hinge_loss(img, txt, max_violation=False)


# 3 local queries against 4 global candidates; positives are off the diagonal on purpose.
SCORES = [
    [0.5, 0.9, 0.6, 0.10],  # pos 0: costs 0.6 (col 1), 0.3 (col 2), 0    -> hardest col 1
    [0.0, 0.9, 0.1, 0.30],  # pos 1: every cost clamped to 0           -> inactive row
    [0.4, 0.2, 0.3, 0.35],
]  # pos 3: costs 0.25, 0.05, 0.15              -> hardest col 0
POS = [0, 1, 3]


@pytest.mark.parametrize(
    "max_violation,loss,grad",
    [
        (True, 0.6 + 0.25, [[-1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, -1]]),
        (False, 0.9 + 0.45, [[-2, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, -3]]),
    ],
)
def test_hand_computed_loss_and_gradient(max_violation, loss, grad):
    scores = torch.tensor(SCORES, dtype=torch.float64, requires_grad=True)
    out = hardest_negative_hinge(scores, torch.tensor(POS), margin=0.2, max_violation=max_violation)
    assert out.item() == pytest.approx(loss)
    out.backward()
    # With max_violation the gradient reaches only each row's positive and its hardest negative.
    torch.testing.assert_close(scores.grad, torch.tensor(grad, dtype=torch.float64))


def test_gradient_only_through_hardest_negatives_on_random_scores():
    scores = torch.rand(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scores.requires_grad_(True)
    hardest_negative_hinge(scores, torch.arange(6), margin=0.5).backward()
    off = scores.detach().clone().fill_diagonal_(-float("inf"))
    for i in range(6):
        j = int(off[i].argmax())
        active = 0.5 + scores[i, j].item() - scores[i, i].item() > 0
        expected = torch.zeros(6, dtype=torch.float64)
        if active:
            expected[j], expected[i] = 1.0, -1.0
        torch.testing.assert_close(scores.grad[i], expected)


@pytest.mark.parametrize("max_violation", [True, False])
@pytest.mark.parametrize("split", [5, 3])
def test_row_split_sums_to_full_loss(split, max_violation):
    # What a distributed loss does: each rank scores its local rows against all global candidates.
    img, txt = embeddings(10, 12, seed=11)
    img, txt = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    full = vse_hinge_loss(img, txt, 0.2, max_violation)
    s = img @ txt.t()
    total = 0
    for rows in (torch.arange(0, split), torch.arange(split, 10)):
        i2t = hardest_negative_hinge(img[rows] @ txt.t(), rows, 0.2, max_violation)
        t2i = hardest_negative_hinge(txt[rows] @ img.t(), rows, 0.2, max_violation)
        # Each half equals the corresponding rows of the square computation.
        torch.testing.assert_close(i2t, per_row(s, max_violation)[rows].sum())
        torch.testing.assert_close(t2i, per_row(s.t(), max_violation)[rows].sum())
        total = total + i2t + t2i
    torch.testing.assert_close(total, full)


def per_row(s, max_violation, margin=0.2):
    """Per-row hinge of a square matrix, via single-row calls (rows are independent)."""
    return torch.stack(
        [hardest_negative_hinge(s[i : i + 1], torch.tensor([i]), margin, max_violation) for i in range(len(s))]
    )


def test_per_row_losses_add_up():
    img, txt = embeddings(6, 8, seed=5)
    s = F.normalize(img, dim=1) @ F.normalize(txt, dim=1).t()
    full = hardest_negative_hinge(s, torch.arange(6))
    assert full > 0
    torch.testing.assert_close(per_row(s, True).sum(), full)


# --- validation ---


@pytest.mark.parametrize(
    "img_shape,txt_shape,match",
    [
        ((4, 8), (5, 8), "same"),
        ((4, 8), (4, 9), "same"),
        ((8,), (8,), "2-D"),
        ((4, 8), (4, 8, 1), "2-D"),
    ],
)
def test_vse_hinge_shape_errors(img_shape, txt_shape, match):
    with pytest.raises(ValueError, match=match):
        vse_hinge_loss(torch.zeros(img_shape), torch.zeros(txt_shape))


def test_hardest_negative_hinge_validation():
    s = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="2-D"):
        hardest_negative_hinge(torch.zeros(5), torch.arange(5))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        hardest_negative_hinge(s, torch.arange(4))
    with pytest.raises(TypeError, match="LongTensor"):
        hardest_negative_hinge(s, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        hardest_negative_hinge(s, torch.tensor([0, 1, 5]))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        hardest_negative_hinge(s, torch.tensor([0, -1, 2]))
