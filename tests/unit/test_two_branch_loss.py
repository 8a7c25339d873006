"""The two-branch ranking loss against a direct, loop-by-loop reading of the paper's Eq. 3-6."""

import pytest
import torch
import torch.nn.functional as F

from vldist.losses.two_branch import two_branch_ranking_loss


def direct_loss(image, text, text_image, margin, top_k, l_image, l_text, l_neighbors, identity=None):
    """Every (anchor, positive) pair, its negatives listed one by one, the K largest hinges summed.
    A candidate is a negative only when its image is another image: another row, or, given each
    image row's identity, a row of another identity (a copy of the same image is no negative)."""
    owner = text_image.tolist()
    ids = list(range(image.shape[0])) if identity is None else identity.tolist()

    def d(a, b):
        return torch.linalg.vector_norm(a - b)

    def top_k_sum(hinges):
        hinges = sorted(hinges, key=lambda h: float(h.detach()), reverse=True)[:top_k]
        return sum((h.clamp(min=0) for h in hinges), torch.tensor(0.0, dtype=image.dtype))

    total = torch.tensor(0.0, dtype=image.dtype)
    for j, i in enumerate(owner):  # sentence j and its image i: the anchors of Eq. 3-6
        other_text = [k for k in range(len(owner)) if ids[owner[k]] != ids[i]]
        other_images = [k for k in range(len(ids)) if ids[k] != ids[i]]
        total = total + l_image * top_k_sum([margin + d(image[i], text[j]) - d(image[i], text[k]) for k in other_text])
        total = total + l_text * top_k_sum([margin + d(text[j], image[i]) - d(text[j], image[k]) for k in other_images])
        for p, ip in enumerate(owner):  # neighbours: another sentence p of image i is the positive
            if ip == i and p != j:
                total = total + l_neighbors * top_k_sum(
                    [margin + d(text[j], text[p]) - d(text[j], text[k]) for k in other_text]
                )
    return total


def batch(n_images=5, seed=0, dim=6):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 4, (n_images,), generator=g)  # 1 to 3 sentences an image
    text_image = torch.repeat_interleave(torch.arange(n_images), counts)
    text_image = text_image[torch.randperm(len(text_image), generator=g)]  # any order
    image = F.normalize(torch.randn(n_images, dim, generator=g, dtype=torch.float64), dim=1)
    # sentences near their image, so that some hinges are active and some are not
    text = F.normalize(
        image[text_image] + 0.9 * torch.randn(len(text_image), dim, generator=g, dtype=torch.float64), dim=1
    )
    return image, text, text_image


@pytest.mark.parametrize("top_k", [1, 3, 50])
@pytest.mark.parametrize("lambdas", [(1.0, 2.0, 0.0), (0.0, 1.0, 0.0), (1.0, 2.0, 0.2), (0.0, 0.0, 1.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_equals_the_direct_formula(top_k, lambdas, seed):
    image, text, text_image = batch(seed=seed)
    got = two_branch_ranking_loss(
        image,
        text,
        text_image,
        margin=0.3,
        top_k=top_k,
        lambda_image=lambdas[0],
        lambda_text=lambdas[1],
        lambda_text_neighbors=lambdas[2],
    )
    expected = direct_loss(image, text, text_image, 0.3, top_k, *lambdas)
    assert float(expected) > 0
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_gradient_equals_the_direct_formulas():
    image, text, text_image = batch(seed=3)
    ours = [x.clone().requires_grad_() for x in (image, text)]
    theirs = [x.clone().requires_grad_() for x in (image, text)]
    two_branch_ranking_loss(*ours, text_image, 0.3, 2, 1.0, 2.0, 0.5).backward()
    direct_loss(*theirs, text_image, 0.3, 2, 1.0, 2.0, 0.5).backward()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_sentences_of_the_same_image_are_never_negatives():
    """Two sentences of one image placed exactly on each other's anchor: were they negatives,
    every hinge against them would be active."""
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    text = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    text_image = torch.tensor([0, 0, 1])
    # perfect embeddings: every positive at distance 0, every negative at sqrt(2) > margin
    loss = two_branch_ranking_loss(image, text, text_image, margin=0.5, top_k=5, lambda_text_neighbors=1.0)
    assert float(loss) == pytest.approx(0.0, abs=1e-3)


def test_fewer_negatives_than_k_counts_all_of_them():
    image, text, text_image = batch(n_images=3, seed=4)
    big = two_branch_ranking_loss(image, text, text_image, top_k=1000, margin=0.5)
    assert torch.allclose(big, direct_loss(image, text, text_image, 0.5, 1000, 1.0, 2.0, 0.0))


def test_bad_inputs_name_what_is_wrong():
    image, text, text_image = batch()
    with pytest.raises(ValueError, match="text_image must index"):
        two_branch_ranking_loss(image, text, text_image + 10)
    with pytest.raises(ValueError, match="same D"):
        two_branch_ranking_loss(image, text[:, :3], text_image)
    with pytest.raises(ValueError, match="long tensor"):
        two_branch_ranking_loss(image, text, text_image.float())
