"""Attention captioner: the base model of Contrastive Learning for captioning (Dai & Lin, NIPS 2017).

An LSTM decoder over the shard's region features, trained by token NLL (the paper's Eq. 1, the MLE
stage). Two decoders, the paper's two base models: AdaptiveAttention (Lu et al. 2017, attention with
a visual sentinel) and Neuraltalk2 (Show and Tell, no attention). Evaluation generates one caption
per image and reports BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (pycocoevalcap) and self-retrieval
(the paper's Table 1). Paper: ../shared/papers/cl-contrastive-captioning.txt.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from vldist.config import JobConfig, Section
from vldist.data.collate import pad_regions, pad_tokens
from vldist.data.samples import read_meta, read_regions, require_region_features
from vldist.data.vocab import Vocab
from vldist.losses import cross_rank_token_nll
from vldist.metrics import caption_scores, self_retrieval_recall
from vldist.metrics.captions import require_java
from vldist.metrics.report import caption_report
from vldist.metrics.self_retrieval import SELF_RETRIEVAL_KS
from vldist.models.caption_scoring import self_retrieval_logprobs
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder
from vldist.models.common import all_real
from vldist.models.generation import generate
from vldist.recipes.base import Recipe, unwrap

DECODERS = {"adaptive_attention": AdaptiveAttentionDecoder, "show_tell": ShowTellDecoder}


class CaptionerConfig(Section):
    decoder: Literal["adaptive_attention", "show_tell"] = Field(
        "adaptive_attention",
        description="adaptive_attention: LSTM + visual sentinel (paper's AA); show_tell: Neuraltalk2",
    )
    hidden: int = Field(512, ge=1, description="LSTM size (paper: 512)")
    embed: int = Field(512, ge=1, description="word and image encoding size (paper: 512)")
    dropout: float = Field(0.5, ge=0, lt=1, description="dropout before the word classifier (paper: 0.5)")
    captions_per_image: int = Field(
        5, ge=1, description="captions of an image trained on per visit, each its own row (official code: 5)"
    )


class CaptionerModel(nn.Module):
    def __init__(self, cfg: CaptionerConfig, region_dim: int, vocab_size: int):
        super().__init__()
        self.decoder = DECODERS[cfg.decoder](
            vocab_size, region_dim, hidden=cfg.hidden, embed=cfg.embed, dropout=cfg.dropout
        )

    def forward(self, regions, mask, tokens) -> torch.Tensor:
        """Teacher-forced logits (B, T-1, V) predicting tokens[:, 1:]."""
        return self.decoder(regions, mask, tokens)


class GeneratesCaptions:
    """What every recipe that writes captions shares (the captioners, L2C): Java for the metrics,
    the generation length, ids back to text."""

    config: JobConfig
    vocab: Vocab

    @property
    def max_generated_len(self) -> int:
        return self.config.eval.max_generated_len or self.config.data.max_caption_len - 1

    def preflight(self, shards=None) -> None:
        require_java()  # the metrics need it: fail before training, not after

    def caption_metrics(self, references: dict, generated: dict) -> dict[str, float]:
        """pycocoevalcap's metrics of the generated captions, with the job's METEOR settings."""
        eval_config = self.config.eval
        return caption_scores(
            references, generated, meteor_timeout=eval_config.meteor_timeout, meteor=eval_config.meteor
        )

    def generate_captions(self, decoder: nn.Module, features: torch.Tensor) -> list[str]:
        """The decoder's captions of region features without padding (`eval` length and beam)."""
        ids = generate(
            decoder,
            features,
            all_real(features),
            self.vocab.start_id,
            self.vocab.end_id,
            self.max_generated_len,
            self.config.eval.beam_size,
        )
        return self.decode(ids)

    def decode(self, ids: torch.Tensor) -> list[str]:
        # "<unk>" would reach the PTB tokenizer as "< unk >"
        return [self.vocab.decode(row).replace("<unk>", "unk") for row in ids.tolist()]

    def encode_some(self, captions: list[str], count: int, rng: random.Random) -> list[list[int]]:
        """`count` of the captions (all when fewer), drawn with rng, as token ids."""
        chosen = rng.sample(captions, min(count, len(captions)))
        return [self.vocab.encode(c, self.config.data.max_caption_len) for c in chosen]


class CaptionerRecipe(GeneratesCaptions, Recipe):
    name = "captioner"
    description = "image captioning: attention LSTM (AdaptiveAttention or Neuraltalk2) by token NLL"
    ModelConfig = CaptionerConfig
    accumulate_negatives_refusal = (
        "its loss has no negatives: each caption's NLL is its own, so plain accumulation already keeps all there is"
    )
    sample_keys = ("json", "regions.npy")
    keeps_max_regions = True  # the first data.max_regions regions of an image; the rest are dropped

    @property
    def cfg(self) -> CaptionerConfig:
        return self.config.model

    def build_model(self) -> nn.Module:
        region_dim = require_region_features(self.feature_dim, self.config.data.shards, "the captioner")
        return CaptionerModel(self.cfg, region_dim, len(self.vocab))

    def checkpointed_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder's whole teacher-forced unroll (CL: the target's; its reference runs without gradient)."""
        return [model.decoder]

    # ------------------------------------------------------------------ samples and batches

    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        captions = self.encode_some(read_meta(raw)["captions"], self.cfg.captions_per_image, rng)
        regions = read_regions(raw, self.feature_dim)[: self.config.data.max_regions]
        return {"regions": regions, "captions": captions}

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        return {
            "key": raw["__key__"],
            "regions": read_regions(raw, self.feature_dim)[: self.config.data.max_regions],
            "references": meta["captions"][: self.config.eval.max_captions_per_image],
        }

    def collate_train(self, samples: list[dict]) -> dict:
        regions, mask = pad_regions([s["regions"] for s in samples], self.config.data.max_regions)
        length = self.config.data.max_caption_len if self.uniform_shapes else None
        tokens, _ = pad_tokens([c for s in samples for c in s["captions"]], length=length)
        # each caption is a row; caption_images maps it to its image's row of `regions`
        counts = torch.tensor([len(s["captions"]) for s in samples])
        return {
            "regions": regions,
            "mask": mask,
            "tokens": tokens,
            "caption_images": torch.repeat_interleave(torch.arange(len(samples)), counts),
        }

    def collate_eval(self, samples: list[dict]) -> dict:
        regions, mask = pad_regions([s["regions"] for s in samples], self.config.data.max_regions)
        return {
            "keys": [s["key"] for s in samples],
            "regions": regions,
            "mask": mask,
            "references": [s["references"] for s in samples],
        }

    # ------------------------------------------------------------------ losses and evaluation

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        rows = batch["caption_images"]
        return {"regions": batch["regions"][rows], "mask": batch["mask"][rows], "tokens": batch["tokens"]}

    def losses(self, logits, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        nll = cross_rank_token_nll(logits, batch["tokens"][:, 1:], self.vocab.pad_id)  # Eq. 1, per token
        return {"loss": nll, "nll": nll.detach()}

    @torch.no_grad()
    def caption(self, model: nn.Module, regions: list, device: torch.device) -> list[str]:
        """One generated caption per image, from each image's (R, F) region features (a user's
        own images: `python -m vldist.caption`)."""
        padded, mask = pad_regions(regions, self.config.data.max_regions)
        ids = generate(
            unwrap(model).decoder,
            padded.to(device),
            mask.to(device),
            self.vocab.start_id,
            self.vocab.end_id,
            self.max_generated_len,
            self.config.eval.beam_size,
        )
        return self.decode(ids)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> dict:
        """Generate one caption per image; score them against the references (pycocoevalcap), and
        rank the first eval.self_retrieval_pool images by ln p(generated caption | image) (not in
        validation: selection uses CIDEr-D only, and the pool costs pool^2 decoder passes)."""
        decoder = unwrap(model).decoder
        was_training = model.training
        model.eval()
        references, generated = {}, {}
        pool_regions, pool_masks, pool_captions = [], [], []
        room = 0 if validation else self.config.eval.self_retrieval_pool
        for batch in batches:
            regions, mask = batch["regions"].to(device), batch["mask"].to(device)
            ids = generate(
                decoder,
                regions,
                mask,
                self.vocab.start_id,
                self.vocab.end_id,
                self.max_generated_len,
                self.config.eval.beam_size,
            )
            for key, refs, caption in zip(batch["keys"], batch["references"], self.decode(ids), strict=True):
                references[key], generated[key] = refs, caption
            if room > 0:
                pool_regions.append(batch["regions"][:room])
                pool_masks.append(batch["mask"][:room])
                pool_captions += [[self.vocab.start_id, *row] for row in _trim(ids[:room])]
                room -= len(pool_masks[-1])
        if not generated:
            raise RuntimeError("the evaluation split yielded no samples")
        result = {"captions": self.caption_metrics(references, generated)}
        if pool_captions:
            tokens, _ = pad_tokens(pool_captions, self.vocab.pad_id)
            logp = self_retrieval_logprobs(
                decoder,
                torch.cat(pool_regions).to(device),
                torch.cat(pool_masks).to(device),
                tokens.to(device),
                self.vocab.pad_id,
            )
            # R@K with K >= the pool counts every caption (100 by construction): only K below it
            ks = [k for k in SELF_RETRIEVAL_KS if k < logp.shape[0]]
            if ks:
                result["self_retrieval"] = self_retrieval_recall(logp, ks)
        model.train(was_training)
        keys = list(generated)[: self.config.eval.examples]
        return {
            **result,
            "n_images": len(generated),
            "n_captions": sum(len(r) for r in references.values()),
            "examples": [{"key": k, "generated": generated[k], "references": references[k]} for k in keys],
        }

    def selection_score(self, metrics: dict) -> float:
        return metrics["captions"]["cider_d"]  # the CL paper's headline metric

    @classmethod
    def headline(cls, metrics: dict) -> dict[str, float]:
        return {
            "cider_d": metrics["captions"]["cider_d"],
            "bleu4": metrics["captions"]["bleu4"],
            "rouge_l": metrics["captions"]["rouge_l"],
        }

    @classmethod
    def report(cls, rows: dict[str, dict], split: str) -> str:
        return caption_report(rows, split)


def _trim(ids: torch.Tensor) -> list[list[int]]:
    """Generated rows without the padding after their end (generate pads with 0)."""
    rows = []
    for row in ids.tolist():
        while row and row[-1] == 0:
            row.pop()
        rows.append(row)
    return rows
