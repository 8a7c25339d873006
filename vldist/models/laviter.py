"""LAViTeR's model: the VTA encoders, the text-to-image GAN (TIM) and the captioner (ITM), and
which of them a training phase updates.

One forward per optimizer update (DDP must see every parameter use inside the wrapped module's
forward): `update="discriminator"` scores real, generated and mismatched pairs for the
discriminators; `update="main"` returns what the recipe's other losses need. Cross-batch losses
(DAMSM, Eqs. 4-8, and its use in L_FI and L_FT) are the recipe's, on the vectors returned here,
because their negatives come from every rank.

Phases (§4.3) freeze modules: a frozen module has requires_grad off and stays in eval mode, so
its batch-norm statistics do not move either (`freeze`, `train`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from vldist.models.alignment_encoders import build_image_encoder, build_text_encoder
from vldist.models.common import all_real, length_mask
from vldist.models.generation import generate
from vldist.models.memory_format import convert_to_channels_last
from vldist.models.text_to_image import (
    Discriminator,
    Generator,
    discriminator_loss,
    generator_adversarial_loss,
    kl_loss,
)
from vldist.models.transformer_captioner import TransformerCaptioner

PHASES = ("pretrain", "vta", "assist", "joint")


class LAViTeRModel(nn.Module):
    def __init__(self, cfg, vocab_size: int, max_caption_len: int, end_id: int, start_id: int):
        super().__init__()
        self.cfg, self.end_id, self.start_id = cfg, end_id, start_id
        dim = cfg.embed_dim
        self.image_encoder = build_image_encoder(cfg.image_encoder, dim, cfg.image_weights, cfg.image_size)
        self.text_encoder = build_text_encoder(
            cfg.text_encoder, vocab_size, dim, cfg.text_heads, cfg.text_layers, cfg.max_words
        )
        self.generator = self.discriminators = self.captioner = None
        if cfg.tim:
            self.generator = Generator(
                dim,
                dim,
                cfg.z_dim,
                cfg.condition_dim,
                cfg.gf_dim,
                cfg.tim_stages,
                cfg.residual_blocks,
                cfg.tim_attend_first,
            )
            self.discriminators = nn.ModuleList(
                Discriminator(64 * 2**s, cfg.df_dim, dim) for s in range(cfg.tim_stages)
            )
        if cfg.itm:
            self.captioner = TransformerCaptioner(
                vocab_size,
                dim,
                cfg.itm_dim,
                cfg.itm_heads,
                cfg.itm_encoder_layers,
                cfg.itm_decoder_layers,
                cfg.itm_feedforward,
                cfg.itm_dropout,
                max_len=max_caption_len,
            )
        # The stand-in for ImageNet pretraining of the embedded job's small trunk (docs/laviter.md):
        # multi-label classification of the objects' attribute words. Only the pretrain phase has it.
        self.label_head = nn.Linear(self.image_encoder.global_channels, vocab_size) if cfg.phase == "pretrain" else None
        self.frozen: list[nn.Module] = []

    def use_channels_last(self) -> LAViTeRModel:
        """Every convolution (E_I's trunk, the generator, the discriminators) and the images in
        NHWC: on CUDA. Images enter through forward, or E_I directly in evaluation."""
        convert_to_channels_last(self, [self, self.image_encoder])
        return self

    # ------------------------------------------------------------------ phases

    def freeze(self, modules: list[nn.Module]) -> None:
        """No gradient and eval mode (batch-norm statistics fixed) for these modules, from now on."""
        for module in modules:
            module.requires_grad_(False)
            module.eval()
            self.frozen.append(module)

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.frozen:  # the trainer's model.train() must not wake them
            module.eval()
        return self

    def set_phase(self, phase: str, trunk: str, frozen_blocks: int) -> None:
        """pretrain trains E_I's trunk on attribute labels (the embedded job's stand-in for ImageNet);
        §4.3: vta trains E_T and E_I's projections (its whole trunk with trunk='trainable');
        assist trains TIM and ITM on the frozen encoders; joint trains everything but E_I's first
        `frozen_blocks` blocks."""
        encoder = self.image_encoder
        if phase == "pretrain":
            self.freeze(
                [
                    m
                    for m in (
                        self.text_encoder,
                        self.generator,
                        self.discriminators,
                        self.captioner,
                        *encoder.projections(),
                    )
                    if m is not None
                ]
            )
        elif phase == "vta":
            self.freeze([m for m in (self.generator, self.discriminators, self.captioner) if m is not None])
            if trunk == "frozen":
                self.freeze(list(encoder.blocks))
        elif phase == "assist":
            self.freeze([encoder, self.text_encoder])
        else:
            self.freeze(list(encoder.blocks[:frozen_blocks]))

    @staticmethod
    def trains(module: nn.Module | None) -> bool:
        return module is not None and any(p.requires_grad for p in module.parameters())

    # ------------------------------------------------------------------ forward

    def encode_text(self, words: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.trains(self.text_encoder)):
            return self.text_encoder(words, lengths)

    def real_pyramid(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The real images at each generator stage's size (AttnGAN loads 64, 128 and 256 px)."""
        sizes = [64 * 2**s for s in range(self.cfg.tim_stages)]
        return [
            images
            if images.shape[-1] == s
            else F.interpolate(images, size=(s, s), mode="bilinear", align_corners=False)
            for s in sizes
        ]

    def forward(
        self,
        images,
        words,
        lengths,
        tokens,
        update: str,
        noise: torch.Tensor | None = None,
        weights: dict | None = None,
        mismatched: torch.Tensor | None = None,
    ) -> dict:
        """mismatched: (B,) for each real image the row of another image's caption, for the
        discriminator's mismatched-text term (default: the next row)."""
        weights = weights or {}
        if self.label_head is not None:  # trunk pretraining: nothing else runs
            return {"label_logits": self.label_head(self.image_encoder.trunk(images)[1])}
        text_words, sentence = self.encode_text(words, lengths)
        word_mask = length_mask(lengths, words.shape[1])
        # The GAN is conditioned on detached text vectors (AttnGAN): E_T learns from DAMSM terms only.
        condition = (sentence.detach(), text_words.detach(), word_mask)
        out: dict = {"words": text_words, "lengths": lengths, "sentence": sentence}
        if update == "discriminator":
            with torch.no_grad():
                fakes = self.generator(noise, *condition)["images"]
            # each real image with another image's caption (never a caption of a copy of itself)
            wrong = condition[0][mismatched] if mismatched is not None else condition[0].roll(1, dims=0)
            out["discriminator"] = sum(
                discriminator_loss(d, real, fake, condition[0], wrong)
                for d, real, fake in zip(self.discriminators, self.real_pyramid(images), fakes, strict=True)
            )
            return out
        encoder_trains = self.trains(self.image_encoder)
        if weights.get("damsm") or weights.get("fake_text") or weights.get("caption"):
            with torch.set_grad_enabled(torch.is_grad_enabled() and encoder_trains):
                out["regions"], out["image"] = self.image_encoder(images)
        if weights.get("caption") and self.trains(self.captioner):
            out["caption_logits"] = self.captioner(out["regions"], all_real(out["regions"]), tokens)
        if (weights.get("generator") or weights.get("fake_image")) and self.trains(self.generator):
            generated = self.generator(noise, *condition)
            fakes = generated["images"]
            out["adversarial"] = sum(
                generator_adversarial_loss(d, fake, condition[0])
                for d, fake in zip(self.discriminators, fakes, strict=True)
            )
            out["kl"] = kl_loss(generated["mu"], generated["logvar"])
            # L_FI: E_I reads the last (largest) generated image; gradient reaches G through it.
            # Generated images must not move E_I's batch-norm statistics, which real images use.
            with running_statistics_kept(self.image_encoder):
                out["fake_regions"], out["fake_image"] = self.image_encoder(fakes[-1])
        if weights.get("fake_text") and (self.trains(self.text_encoder) or encoder_trains):
            generated_words, generated_lengths = self.generated_text(out, tokens)
            out["generated_words"], out["generated_sentence"] = self.text_encoder(generated_words, generated_lengths)
            out["generated_lengths"] = generated_lengths
        return out

    def generated_text(self, out: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The captioner's text for L_FT as E_T's input (word ids, lengths), never differentiable:
        'teacher_forced' is the authors' code (argmax of the teacher-forced logits), 'free_running'
        decodes greedily from the image alone, as the paper implies."""
        with torch.no_grad():
            if self.cfg.generated_text == "teacher_forced":
                logits = out.get("caption_logits")
                if logits is None:
                    logits = self.captioner(out["regions"], all_real(out["regions"]), tokens)
                logits = logits.clone()
                logits[..., [0, self.start_id]] = float("-inf")  # never <pad> or <start> mid-caption
                ids = logits.argmax(dim=-1)
            else:
                ids = generate(
                    self.captioner,
                    out["regions"].detach(),
                    all_real(out["regions"]),
                    self.start_id,
                    self.end_id,
                    self.cfg.max_words + 1,
                    1,
                )
        return caption_words(ids, self.end_id, self.cfg.max_words)


@contextmanager
def running_statistics_kept(module: nn.Module):
    """Batch norms of `module` normalise with their running statistics and leave them as they are
    (eval mode) for the duration; the rest of the module, and its gradients, are untouched."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    for m in norms:
        m.eval()
    try:
        yield
    finally:
        for m in norms:
            m.train()


def caption_words(ids: torch.Tensor, end_id: int, max_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated ids (B, L) after <start> -> E_T's input: words before <end> (at most max_words),
    padding 0 after them, and their count (at least 1: an empty caption reads as one padding word)."""
    ids = ids[:, :max_words]
    ended = (ids == end_id).long().cumsum(dim=1) > 0
    words = ids.masked_fill(ended, 0)
    lengths = (~ended).sum(dim=1).clamp(min=1)
    return words, lengths
