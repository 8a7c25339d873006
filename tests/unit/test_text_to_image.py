"""TIM (AttnGAN-style text-to-image): shapes, KL, word-attention masking and the GAN losses."""

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from vldist.models.text_to_image import (
    ConditioningAugmentation,
    Discriminator,
    Generator,
    WordAttention,
    discriminator_loss,
    generator_adversarial_loss,
    kl_loss,
)

B, T, WORD, SENT = 2, 5, 6, 7


def _text(seed=0):
    g = torch.Generator().manual_seed(seed)
    words = torch.randn(B, T, WORD, generator=g)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    return torch.randn(B, SENT, generator=g), words, mask


def _generator(**kw):
    torch.manual_seed(0)
    return Generator(WORD, SENT, z_dim=8, condition_dim=5, gf_dim=4, residual_blocks=1, **kw)


@pytest.mark.parametrize("stages,attend_first,n_attention", [(1, True, 1), (1, False, 0), (3, False, 2)])
def test_generator_shapes_and_range(stages, attend_first, n_attention):
    G = _generator(stages=stages, attend_first=attend_first)
    sentence, words, mask = _text()
    out = G(G.sample_noise(B), sentence, words, mask)
    assert [tuple(im.shape) for im in out["images"]] == [(B, 3, 64 * 2**s, 64 * 2**s) for s in range(stages)]
    for im in out["images"]:
        assert im.abs().max() <= 1 and torch.isfinite(im).all()
    assert out["mu"].shape == out["logvar"].shape == (B, 5)
    sizes = [64] if attend_first else [64, 128][:n_attention]
    assert [tuple(a.shape) for a in out["attention"]] == [(B, T, s, s) for s in sizes]
    for a in out["attention"]:
        torch.testing.assert_close(a.sum(dim=1), torch.ones(B, *a.shape[-2:]))


def test_sample_noise_is_standard_normal_and_seedable():
    G = _generator()
    z1 = G.sample_noise(3, generator=torch.Generator().manual_seed(1))
    z2 = G.sample_noise(3, generator=torch.Generator().manual_seed(1))
    assert z1.shape == (3, 8) and torch.equal(z1, z2)


def test_kl_matches_closed_form_gaussian_kl():
    mu, logvar = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
    expected = kl_divergence(Normal(mu, torch.exp(0.5 * logvar)), Normal(0.0, 1.0)).mean()
    torch.testing.assert_close(kl_loss(mu, logvar).double(), expected, rtol=1e-5, atol=1e-6)
    assert kl_loss(torch.zeros(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_conditioning_augmentation_reparametrises_with_given_noise():
    ca = ConditioningAugmentation(SENT, 5)
    sentence = torch.randn(B, SENT)
    eps = torch.randn(B, 5)
    c, mu, logvar = ca(sentence, noise=eps)
    torch.testing.assert_close(c, mu + eps * torch.exp(logvar / 2))
    c0, mu0, _ = ca(sentence, noise=torch.zeros(B, 5))
    torch.testing.assert_close(c0, mu0)


def test_word_attention_gives_padding_exactly_zero_weight():
    att = WordAttention(channels=4, word_dim=WORD)
    _, words, mask = _text()
    context, attn = att(torch.randn(B, 4, 3, 3), words, mask)
    assert context.shape == (B, 4, 3, 3) and attn.shape == (B, T, 3, 3)
    assert (attn[0, 3:] == 0).all() and (attn[0, :3] > 0).all()
    context, attn = att(torch.randn(B, 4, 3, 3), words, torch.zeros(B, T, dtype=torch.bool))
    assert (attn == 0).all() and (context == 0).all()


@pytest.mark.parametrize("stages,attend_first", [(1, True), (2, False)])
def test_padding_word_vectors_do_not_change_the_output(stages, attend_first):
    G = _generator(stages=stages, attend_first=attend_first).eval()
    sentence, words, mask = _text()
    z, eps = torch.randn(B, 8), torch.randn(B, 5)
    changed = words.clone()
    changed[~mask] = torch.randn(int((~mask).sum()), WORD) * 100
    with torch.no_grad():
        a = G(z, sentence, words, mask, condition_noise=eps)
        b = G(z, sentence, changed, mask, condition_noise=eps)
        real_changed = G(z, sentence, words + 1, mask, condition_noise=eps)
    for x, y in zip(a["images"], b["images"], strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a["images"][-1], real_changed["images"][-1])  # real words do matter


@pytest.mark.parametrize("size", [64, 128, 256])
def test_discriminator_shapes(size):
    D = Discriminator(size, df_dim=4, condition_dim=SENT)
    code = D(torch.randn(B, 3, size, size))
    assert code.shape == (B, 32, 4, 4)
    assert D.uncond_logits(code).shape == (B,)
    assert D.cond_logits(code, torch.randn(B, SENT)).shape == (B,)


def test_discriminator_rejects_bad_sizes():
    with pytest.raises(ValueError):
        Discriminator(96, df_dim=4, condition_dim=SENT)
    with pytest.raises(ValueError):
        Discriminator(64, df_dim=4, condition_dim=SENT)(torch.randn(B, 3, 128, 128))


def _nll_real(x):
    return -torch.log(torch.sigmoid(x.double())).mean()


def _nll_fake(x):
    return -torch.log(1 - torch.sigmoid(x.double())).mean()


def test_losses_match_direct_formula():
    torch.manual_seed(0)
    D = Discriminator(64, df_dim=4, condition_dim=SENT).eval()  # eval: same logits on every call
    real, fake = torch.rand(B, 3, 64, 64) * 2 - 1, torch.rand(B, 3, 64, 64) * 2 - 1
    sentence = torch.randn(B, SENT)
    wrong = sentence.roll(1, dims=0)
    with torch.no_grad():
        cr, cf = D(real), D(fake)
        expected_d = (_nll_real(D.uncond_logits(cr)) + _nll_real(D.cond_logits(cr, sentence))) / 2 + (
            _nll_fake(D.uncond_logits(cf))
            + _nll_fake(D.cond_logits(cf, sentence))
            + _nll_fake(D.cond_logits(cr, wrong))
        ) / 3
        expected_g = _nll_real(D.uncond_logits(cf)) + _nll_real(D.cond_logits(cf, sentence))
        loss_d = discriminator_loss(D, real, fake, sentence, wrong)
        loss_g = generator_adversarial_loss(D, fake, sentence)
    assert loss_d.dtype == loss_g.dtype == torch.float32
    torch.testing.assert_close(loss_d.double(), expected_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_g.double(), expected_g, rtol=1e-5, atol=1e-6)


def test_discriminator_loss_gives_no_gradient_to_the_generator():
    G = _generator(stages=1, attend_first=True)
    D = Discriminator(64, df_dim=4, condition_dim=SENT)
    sentence, words, mask = _text()
    fake = G(G.sample_noise(B), sentence, words, mask)["images"][0]
    discriminator_loss(D, torch.rand(B, 3, 64, 64) * 2 - 1, fake, sentence, sentence.roll(1, 0)).backward()
    assert all(p.grad is None for p in G.parameters())
    assert all(p.grad is not None for p in D.parameters())
    # while the adversarial loss does reach the generator
    generator_adversarial_loss(D, fake, sentence).backward()
    assert all(p.grad is not None for p in G.parameters())
