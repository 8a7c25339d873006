"""LAViTeR's text-to-image model (TIM, §3.2): an AttnGAN generator/discriminator cascade.

Follows AttnGAN (Xu et al. 2018, taoxugit/AttnGAN code/model.py and code/miscc/losses.py) as
summarised in /work/shared/papers/notes-laviter.md (section TIM):

- the sentence vector conditions the generator through conditioning augmentation (fc → GLU → μ,
  log σ²; c ~ N(μ, σ²)), with AttnGAN's KL term (`kl_loss`);
- the init stage maps z ‖ c to a 4x4 x 16·gf code and upsamples it four times to 64x64 x gf; each
  further stage attends from every pixel over the caption's words (`WordAttention`), concatenates
  the word context, runs residual blocks and upsamples by 2; every stage has its own image head;
- one discriminator per scale gives an unconditional and a sentence-conditional logit from a 4x4
  code; the losses are AttnGAN's (real/fake/mismatched-text BCE), on logits and in float32.

Sizes: the paper job uses 3 stages (64/128/256 px) with COCO's gf_dim 48, df_dim 96, z_dim 100,
condition_dim 100, 3 residual blocks (CUB: 32 / 64 / 2); the embedded-data job uses a single 64-px
stage with `attend_first=True` so that it is still conditioned on the words (see `Generator`).
Weights get AttnGAN's `weights_init` (orthogonal conv/linear, BN weight ~ N(1, 0.02)) at
construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attngan_init_(module: nn.Module) -> None:
    """AttnGAN's weights_init: GAN training is sensitive to it, so both nets apply it by default."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(m.weight, 1.0)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


def kl_loss(mu: Tensor, logvar: Tensor) -> Tensor:
    """AttnGAN's KL_loss: KL(N(μ, σ²) ‖ N(0, I)) averaged over batch *and* dimensions, float32."""
    mu, logvar = mu.float(), logvar.float()
    return torch.mean(-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()))


def _conv3x3(in_channels: int, out_channels: int) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)


def _glu_block(in_channels: int, out_channels: int, upsample: bool) -> nn.Sequential:
    """(nearest x2 →) conv3x3 → BN → GLU: AttnGAN's upBlock, or its same-size variant."""
    layers: list[nn.Module] = [nn.Upsample(scale_factor=2, mode="nearest")] if upsample else []
    layers += [_conv3x3(in_channels, out_channels * 2), nn.BatchNorm2d(out_channels * 2), nn.GLU(dim=1)]
    return nn.Sequential(*layers)


class _ResBlock(nn.Module):
    """AttnGAN's ResBlock: x + BN(conv(GLU(BN(conv(x)))))."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            _conv3x3(channels, channels * 2),
            nn.BatchNorm2d(channels * 2),
            nn.GLU(dim=1),
            _conv3x3(channels, channels),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class ConditioningAugmentation(nn.Module):
    """Sentence vector → (c, μ, log σ²) with c = μ + ε·σ (AttnGAN's CA_NET).

    Sampling happens in eval mode too, as in AttnGAN; pass `noise` (or a torch.Generator) for
    reproducible outputs."""

    def __init__(self, sentence_dim: int, condition_dim: int):
        super().__init__()
        self.condition_dim = condition_dim
        self.fc = nn.Linear(sentence_dim, condition_dim * 4)
        self.glu = nn.GLU(dim=1)

    def forward(
        self, sentence: Tensor, noise: Tensor | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        mu, logvar = self.glu(self.fc(sentence)).chunk(2, dim=1)
        if noise is None:
            noise = _randn(mu.shape, generator, device=mu.device, dtype=mu.dtype)
        return mu + noise * torch.exp(0.5 * logvar), mu, logvar


class WordAttention(nn.Module):
    """Attention from each pixel of a hidden map over the caption's words (AttnGAN's
    GlobalAttentionGeneral): words are projected to the map's channels (1x1 conv = linear, no bias)
    and serve as both keys and values.

    `word_mask` (B, T) is True for real words. Padding words are zeroed before the projection and
    their attention is multiplied by 0 after the softmax, so they get exactly zero weight and their
    vectors cannot change the output; a caption with no real word gets a zero context."""

    def __init__(self, channels: int, word_dim: int):
        super().__init__()
        self.project = nn.Linear(word_dim, channels, bias=False)

    def forward(self, hidden: Tensor, words: Tensor, word_mask: Tensor) -> tuple[Tensor, Tensor]:
        """(context (B, C, H, W), attention (B, T, H, W)); attention sums to 1 over real words."""
        b, c, h, w = hidden.shape
        mask = word_mask.bool()
        keys = self.project(words.masked_fill(~mask[..., None], 0.0))  # (B, T, C)
        query = hidden.flatten(2).transpose(1, 2)  # (B, HW, C)
        scores = torch.bmm(query, keys.transpose(1, 2)).float()  # (B, HW, T)
        scores = scores.masked_fill(~mask[:, None, :], torch.finfo(scores.dtype).min)
        attn = (scores.softmax(dim=-1) * mask[:, None, :]).to(keys.dtype)
        context = torch.bmm(attn, keys).transpose(1, 2).reshape(b, c, h, w)
        return context, attn.transpose(1, 2).reshape(b, -1, h, w)


class _InitStage(nn.Module):
    """z ‖ c → fc (BN, GLU) → 4x4 x 16·gf → four upBlocks → 64x64 x gf (AttnGAN's INIT_STAGE_G)."""

    def __init__(self, in_dim: int, gf_dim: int):
        super().__init__()
        self.channels = gf_dim * 16
        self.fc = nn.Sequential(
            nn.Linear(in_dim, self.channels * 4 * 4 * 2, bias=False),
            nn.BatchNorm1d(self.channels * 4 * 4 * 2),
            nn.GLU(dim=1),
        )
        self.up = nn.Sequential(
            *[_glu_block(self.channels // 2**i, self.channels // 2 ** (i + 1), upsample=True) for i in range(4)]
        )

    def forward(self, z_c: Tensor) -> Tensor:
        return self.up(self.fc(z_c).view(-1, self.channels, 4, 4))


class _AttentionStage(nn.Module):
    """Word attention → concat → residual blocks → (upsample) GLU block back to gf channels
    (AttnGAN's NEXT_STAGE_G; `upsample=False` is the same-size refinement of `attend_first`)."""

    def __init__(self, gf_dim: int, word_dim: int, residual_blocks: int, upsample: bool):
        super().__init__()
        self.attention = WordAttention(gf_dim, word_dim)
        self.residual = nn.Sequential(*[_ResBlock(gf_dim * 2) for _ in range(residual_blocks)])
        self.out = _glu_block(gf_dim * 2, gf_dim, upsample=upsample)

    def forward(self, hidden: Tensor, words: Tensor, word_mask: Tensor) -> tuple[Tensor, Tensor]:
        context, attn = self.attention(hidden, words, word_mask)
        return self.out(self.residual(torch.cat([hidden, context], dim=1))), attn


class Generator(nn.Module):
    """AttnGAN's G_NET: `stages` images at 64·2^s px, s = 0..stages-1.

    `attend_first=True` is a departure from AttnGAN (whose first stage sees only z and the
    sentence condition): a word-attention + residual refinement, without upsampling, runs on the
    64-px hidden map before the first image head. The one-stage embedded-data job turns it on so
    that its only stage is conditioned on word attention; it is off by default (the paper job).

    forward(noise (B, z_dim) ~ N(0, I) — see `sample_noise`, sentence (B, S), words (B, T, W),
    word_mask (B, T) bool, True = real word) → {"images": list of (B, 3, 64·2^s, 64·2^s) in [-1, 1],
    "mu", "logvar": (B, condition_dim), "attention": list of (B, T, H, W), one per attention
    stage, at that stage's input resolution (64, 128, ...)}."""

    def __init__(
        self,
        word_dim: int,
        sentence_dim: int,
        z_dim: int = 100,
        condition_dim: int = 100,
        gf_dim: int = 32,
        stages: int = 1,
        residual_blocks: int = 2,
        attend_first: bool = False,
    ):
        super().__init__()
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        self.z_dim = z_dim
        self.ca = ConditioningAugmentation(sentence_dim, condition_dim)
        self.init_stage = _InitStage(z_dim + condition_dim, gf_dim)
        self.first_refine = _AttentionStage(gf_dim, word_dim, residual_blocks, upsample=False) if attend_first else None
        self.next_stages = nn.ModuleList(
            [_AttentionStage(gf_dim, word_dim, residual_blocks, upsample=True) for _ in range(stages - 1)]
        )
        self.image_heads = nn.ModuleList([nn.Sequential(_conv3x3(gf_dim, 3), nn.Tanh()) for _ in range(stages)])
        attngan_init_(self)

    def sample_noise(
        self, batch: int, generator: torch.Generator | None = None, device: torch.device | None = None
    ) -> Tensor:
        """z ~ N(0, I), (batch, z_dim), on the model's device unless `device` is given."""
        device = device if device is not None else self.ca.fc.weight.device
        return _randn((batch, self.z_dim), generator, device=device)

    def forward(
        self, noise: Tensor, sentence: Tensor, words: Tensor, word_mask: Tensor, condition_noise: Tensor | None = None
    ) -> dict[str, Tensor | list[Tensor]]:
        """`condition_noise` (B, condition_dim) fixes the conditioning augmentation's ε."""
        c, mu, logvar = self.ca(sentence, noise=condition_noise)
        hidden = self.init_stage(torch.cat([noise, c], dim=1))
        attention = []
        if self.first_refine is not None:
            hidden, attn = self.first_refine(hidden, words, word_mask)
            attention.append(attn)
        images = [self.image_heads[0](hidden)]
        for stage, head in zip(self.next_stages, self.image_heads[1:], strict=True):
            hidden, attn = stage(hidden, words, word_mask)
            attention.append(attn)
            images.append(head(hidden))
        return {"images": images, "mu": mu, "logvar": logvar, "attention": attention}


def _down_block(in_channels: int, out_channels: int, batch_norm: bool = True) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, 4, 2, 1, bias=False)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    return layers + [nn.LeakyReLU(0.2, inplace=True)]


def _conv3x3_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [_conv3x3(in_channels, out_channels), nn.BatchNorm2d(out_channels), nn.LeakyReLU(0.2, inplace=True)]


class Discriminator(nn.Module):
    """AttnGAN's D_NET64/128/256 for `size` = 64·2^k: image → 4x4 x 8·df code.

    Four stride-2 convs (no BN on the first) reach size/16; for 128 and 256 further down blocks
    (8df → 16df → 32df) reach 4x4 and 3x3 blocks bring the channels back to 8df. `condition_dim` is
    the sentence vector's size (AttnGAN conditions D on the raw sentence embedding, 256 there).
    Logits are raw (AttnGAN ends with a sigmoid; the losses here use BCE-with-logits)."""

    def __init__(self, size: int, df_dim: int = 64, condition_dim: int = 256):
        super().__init__()
        extra = (size // 64).bit_length() - 1
        if size < 64 or size != 64 * 2**extra:
            raise ValueError(f"size must be 64·2^k, got {size}")
        self.size = size
        self.condition_dim = condition_dim
        layers = _down_block(3, df_dim, batch_norm=False)
        for i in range(3):
            layers += _down_block(df_dim * 2**i, df_dim * 2 ** (i + 1))
        for i in range(extra):
            layers += _down_block(df_dim * 8 * 2**i, df_dim * 8 * 2 ** (i + 1))
        for i in reversed(range(extra)):
            layers += _conv3x3_block(df_dim * 8 * 2 ** (i + 1), df_dim * 8 * 2**i)
        self.encode = nn.Sequential(*layers)
        self.uncond_out = nn.Conv2d(df_dim * 8, 1, kernel_size=4, stride=4)
        self.joint = nn.Sequential(*_conv3x3_block(df_dim * 8 + condition_dim, df_dim * 8))
        self.cond_out = nn.Conv2d(df_dim * 8, 1, kernel_size=4, stride=4)
        attngan_init_(self)

    def forward(self, image: Tensor) -> Tensor:
        """(B, 3, size, size) → code (B, 8·df, 4, 4)."""
        if image.shape[-2:] != (self.size, self.size):
            raise ValueError(f"expected {self.size}x{self.size} images, got {tuple(image.shape[-2:])}")
        return self.encode(image)

    def uncond_logits(self, code: Tensor) -> Tensor:
        return self.uncond_out(code).view(-1)

    def cond_logits(self, code: Tensor, sentence: Tensor) -> Tensor:
        """The sentence (B, condition_dim) is broadcast over the 4x4 code before a joint conv."""
        cond = sentence.to(code.dtype)[:, :, None, None].expand(-1, -1, *code.shape[-2:])
        return self.cond_out(self.joint(torch.cat([code, cond], dim=1))).view(-1)


def _bce(logits: Tensor, target: float) -> Tensor:
    logits = logits.float()
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def discriminator_loss(
    discriminator: Discriminator, real: Tensor, fake: Tensor, sentence: Tensor, wrong_sentence: Tensor
) -> Tensor:
    """AttnGAN's errD = (real_uncond + real_cond)/2 + (fake_uncond + fake_cond + wrong_cond)/3.

    `fake` is detached here, so the generator gets no gradient from this loss. `wrong_sentence` is
    a mismatched sentence for each real image (supplied by the caller, e.g. rolled by one within
    the global batch; AttnGAN pairs real[:-1] with sentence[1:]). Real and fake go through D in
    separate calls, as in AttnGAN, so BatchNorm statistics are not mixed."""
    real_code = discriminator(real)
    fake_code = discriminator(fake.detach())
    real_err = (
        _bce(discriminator.uncond_logits(real_code), 1.0) + _bce(discriminator.cond_logits(real_code, sentence), 1.0)
    ) / 2
    fake_err = (
        _bce(discriminator.uncond_logits(fake_code), 0.0)
        + _bce(discriminator.cond_logits(fake_code, sentence), 0.0)
        + _bce(discriminator.cond_logits(real_code, wrong_sentence), 0.0)
    ) / 3
    return real_err + fake_err


def generator_adversarial_loss(discriminator: Discriminator, fake: Tensor, sentence: Tensor) -> Tensor:
    """AttnGAN's errG + cond_errG for one scale: BCE of D's unconditional and conditional logits on
    `fake` against "real" (the code's form; Eq. 9's ½ factors are not applied, as in AttnGAN)."""
    code = discriminator(fake)
    return _bce(discriminator.uncond_logits(code), 1.0) + _bce(discriminator.cond_logits(code, sentence), 1.0)


def _randn(shape, generator: torch.Generator | None, **kwargs) -> Tensor:
    """torch.randn, passing `generator` only when there is one: the same draws from the default
    generator, and a call torch.compile traces with a dynamic batch size (randn's generator
    overload takes only concrete sizes)."""
    return torch.randn(shape, **kwargs) if generator is None else torch.randn(shape, generator=generator, **kwargs)
