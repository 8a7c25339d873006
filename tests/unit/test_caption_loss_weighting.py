"""VSRN's caption loss L_G weighs what the official code weighs: its `LanguageModelCriterion` (the
video-caption code VSRN builds on) sums each caption's masked token NLLs and divides by the batch
size. Written here as that code computes it, beside the per-token mean that `model.
caption_loss_reduction=token` keeps."""

import pytest
import torch
from torch import nn

from vldist.losses import cross_rank_caption_nll, cross_rank_token_nll


def official_language_model_criterion(logits, target, mask):
    """LanguageModelCriterion.forward: NLLLoss(reduce=False) on log-probabilities, times the mask,
    summed, over the batch size."""
    batch_size = logits.shape[0]
    log_probs = torch.log_softmax(logits, dim=2).contiguous().view(-1, logits.shape[2])
    loss = nn.NLLLoss(reduction="none")(log_probs, target.contiguous().view(-1))
    return torch.sum(loss * mask.contiguous().view(-1)) / batch_size


def captions(seed=0, b=6, t=9, v=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([9, 3, 5, 1, 7, 4])[:b]
    targets = torch.randint(1, v, (b, t), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logits, targets.masked_fill(~mask, 0), mask


def test_caption_loss_equals_the_official_criterion_with_its_gradient():
    logits, targets, mask = captions()
    ours = cross_rank_caption_nll(logits, targets, pad_id=0)
    official = official_language_model_criterion(logits, targets, mask.double())
    assert ours.item() == pytest.approx(official.item(), rel=1e-6)  # computed in float32
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_official,) = torch.autograd.grad(official, logits)
    assert torch.allclose(g_ours.double(), g_official, atol=1e-7)


def test_the_per_token_mean_is_smaller_by_the_mean_caption_length():
    logits, targets, mask = captions(seed=1)
    per_caption = cross_rank_caption_nll(logits, targets)
    per_token = cross_rank_token_nll(logits, targets)
    words_per_caption = mask.sum() / mask.shape[0]
    assert per_caption.item() == pytest.approx(per_token.item() * words_per_caption.item(), rel=1e-6)


@pytest.mark.parametrize("reduction", ["caption", "token"])
def test_vsrn_takes_the_official_weighting_by_default(reduction):
    from vldist.data.vocab import Vocab
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe

    vocab = Vocab(["red", "blue", "circle", "square", "left", "of"])
    overrides = [
        "model.embed_size=8",
        "model.word_dim=4",
        "model.decoder_hidden=8",
        "model.decoder_dropout=0",
        "data.max_regions=3",
    ]
    default = load_config("vsrn", overrides)
    assert default.model.caption_loss_reduction == "caption"
    recipe = VSRNRecipe(
        load_config("vsrn", [*overrides, f"model.caption_loss_reduction={reduction}"]), vocab, feature_dim=5
    )
    torch.manual_seed(0)
    model = recipe.build_model().eval()
    samples = [
        {"regions": torch.randn(3, 5).numpy(), "tokens": vocab.encode(c)}
        for c in ["red circle left of blue square", "blue square", "red", "circle left of square"]
    ]
    batch = recipe.collate_train(samples)
    with torch.no_grad():
        caption = recipe.training_losses(model, batch)["caption"]
        logits = model(batch["regions"], batch["mask"], batch["tokens"], batch["lengths"])["caption_logits"]
        targets = batch["tokens"][:, 1:]
        mask = (targets != vocab.pad_id).double()
        official = official_language_model_criterion(logits.double(), targets, mask)
    expected = official if reduction == "caption" else official * len(samples) / mask.sum()
    assert caption.item() == pytest.approx(expected.item(), rel=1e-5)
