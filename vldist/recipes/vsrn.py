"""VSRN: Visual Semantic Reasoning for Image-Text Matching (Li et al., ICCV 2019).

Image: region features -> fc + l2norm -> n RRR GCN layers -> GRU global reasoning -> I.
Text: GRU sentence encoder -> C. Loss: L = L_M (VSE++ hardest-negative hinge) + L_G (caption NLL
of an attention decoder over the reasoned regions V*). Paper: ../shared/papers/vsrn-*.txt.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from vldist.config import Section
from vldist.data.collate import pad_regions, pad_tokens
from vldist.data.samples import read_meta, read_regions, require_region_features
from vldist.losses import cross_rank_caption_nll, cross_rank_token_nll, cross_rank_vse_hinge_loss
from vldist.metrics import retrieval_protocols
from vldist.metrics.report import chance_recall, retrieval_report
from vldist.models.caption_decoder import AttentionCaptionDecoder
from vldist.models.image_encoder import RegionReasoningEncoder
from vldist.models.text_encoder import GRUTextEncoder
from vldist.recipes.base import Recipe
from vldist.recipes.capabilities import joined_rows


class VSRNConfig(Section):
    embed_size: int = Field(2048, ge=1, description="joint embedding size D (paper: 2048)")
    word_dim: int = Field(300, ge=1, description="word embedding size (paper: 300)")
    rrr_layers: int = Field(4, ge=0, le=8, description="region relationship reasoning layers (paper: 4)")
    affinity_norm: Literal["count", "softmax"] = Field("count", description="RRR affinity normalisation")
    gcn_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="RRR affinity kernel: auto = fused Triton on CUDA, PyTorch reference on CPU"
    )
    gcn_products: Literal["auto", "folded", "direct"] = Field(
        "auto",
        description="RRR projections: folded = their weights multiplied first, the same layer in fewer "
        "multiply-adds when a batch has more region rows than embed_size; auto = folded there in fp32 on "
        "the PyTorch affinity (vldist/models/gcn.py)",
    )
    global_reasoning: Literal["gru", "mean"] = Field("gru", description="GRU reasoning or the Mean-pool ablation")
    region_order: Literal["stored", "size", "random"] = Field(
        "stored", description="order regions enter the GRU: as stored (detector order), by box size, random"
    )
    caption_loss: bool = Field(True, description="add the generation loss L_G (False: the paper's 4RRR+GSR*)")
    caption_loss_weight: float = Field(1.0, ge=0)
    caption_loss_reduction: Literal["caption", "token"] = Field(
        "caption",
        description="L_G per caption: its token NLLs summed, averaged over captions (the official code's "
        "LanguageModelCriterion); token: the mean over all real tokens (about 1/12 as strong on COCO)",
    )
    decoder_hidden: int = Field(512, ge=1)
    margin: float = Field(0.2, ge=0, description="hinge margin alpha (Eq. 8)")
    max_violation: bool = Field(True, description="hardest negative (VSE++) instead of the sum over negatives")
    max_violation_warmup_epochs: int = Field(
        0, ge=0, description="epochs of sum-over-negatives before hardest negatives (VSE-infinity's warm-up; paper: 0)"
    )
    gather_negatives: bool = Field(
        True, description="hardest negatives over the global batch (all ranks); False: each rank's slice only"
    )
    decoder_dropout: float = Field(0.1, ge=0, lt=1)


class VSRNModel(nn.Module):
    def __init__(self, cfg: VSRNConfig, region_dim: int, vocab_size: int):
        super().__init__()
        self.image = RegionReasoningEncoder(
            region_dim,
            cfg.embed_size,
            cfg.rrr_layers,
            cfg.affinity_norm,
            cfg.global_reasoning,
            cfg.gcn_kernel,
            cfg.gcn_products,
        )
        self.text = GRUTextEncoder(vocab_size, cfg.word_dim, cfg.embed_size)
        self.decoder = (
            AttentionCaptionDecoder(vocab_size, cfg.embed_size, cfg.word_dim, cfg.decoder_hidden, cfg.decoder_dropout)
            if cfg.caption_loss
            else None
        )

    def forward(self, regions, mask, tokens, lengths) -> dict[str, torch.Tensor]:
        image, v_star = self.image(regions, mask)
        out = {"image": image, "text": self.text(tokens, lengths)}
        if self.decoder is not None:
            out["caption_logits"] = self.decoder(v_star, mask, tokens)
        return out

    def embed_images(self, regions, mask) -> torch.Tensor:
        return self.image(regions, mask)[0]

    def embed_captions(self, tokens, lengths) -> torch.Tensor:
        return self.text(tokens, lengths)


class VSRNRecipe(Recipe):
    name = "vsrn"
    description = "image-text matching: region GCN (RRR) + GRU reasoning, VSE++ hinge + caption loss"
    ModelConfig = VSRNConfig
    sample_keys = ("json", "regions.npy")
    keeps_max_regions = True  # the first data.max_regions regions of an image; the rest are dropped

    @property
    def cfg(self) -> VSRNConfig:
        return self.config.model

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_epoch(0)

    def start_epoch(self, epoch: int) -> None:
        # Hardest negatives from a random start can collapse every embedding onto one point
        # (L_M stuck at 2 * batch * margin); a few epochs over all negatives first avoids it.
        self.hardest_negatives = self.cfg.max_violation and epoch >= self.cfg.max_violation_warmup_epochs

    def build_model(self) -> nn.Module:
        region_dim = require_region_features(self.feature_dim, self.config.data.shards, "VSRN")
        return VSRNModel(self.cfg, region_dim, len(self.vocab))

    def checkpointed_blocks(self, model: VSRNModel) -> list[nn.Module]:
        """Each RRR layer, and the caption decoder (each time step of its unroll: it declares checkpoint_steps)."""
        return [*model.image.rrr, *([model.decoder] if model.decoder is not None else [])]

    # ------------------------------------------------------------------ samples and batches

    def _regions(self, raw: dict, rng: random.Random) -> np.ndarray:
        regions = read_regions(raw, self.feature_dim)
        meta = raw["meta"]
        order = self.cfg.region_order
        if order == "size":
            boxes = meta.get("region_boxes") or []
            if len(boxes) == len(regions):
                areas = [(b[2] - b[0]) * (b[3] - b[1]) for b in boxes]
                regions = regions[np.argsort(areas, kind="stable")[::-1]]
        elif order == "random":
            regions = regions[rng.sample(range(len(regions)), len(regions))]
        return regions[: self.config.data.max_regions]

    def _decode(self, raw: dict) -> dict:
        raw["meta"] = read_meta(raw)
        return raw

    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        raw = self._decode(raw)
        caption = rng.choice(raw["meta"]["captions"])  # one caption per image visit
        return {
            "regions": self._regions(raw, rng),
            "tokens": self.vocab.encode(caption, self.config.data.max_caption_len),
        }

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        raw = self._decode(raw)
        # every caption the image has, up to the protocol's cap (COCO: the first 5 of 5-7)
        captions = raw["meta"]["captions"][: self.config.eval.max_captions_per_image]
        region_rng = random.Random(raw["__key__"])  # a fixed order per image in evaluation
        return {
            "key": raw["__key__"],
            "regions": self._regions(raw, region_rng),
            "captions": [self.vocab.encode(c, self.config.data.max_caption_len) for c in captions],
        }

    def collate_train(self, samples: list[dict]) -> dict:
        regions, mask = pad_regions([s["regions"] for s in samples], self.config.data.max_regions)
        length = self.config.data.max_caption_len if self.uniform_shapes else None
        tokens, lengths = pad_tokens([s["tokens"] for s in samples], length=length)
        return {"regions": regions, "mask": mask, "tokens": tokens, "lengths": lengths}

    def collate_eval(self, samples: list[dict]) -> dict:
        regions, mask = pad_regions([s["regions"] for s in samples], self.config.data.max_regions)
        tokens, lengths = pad_tokens([c for s in samples for c in s["captions"]])
        return {
            "keys": [s["key"] for s in samples],
            "regions": regions,
            "mask": mask,
            "tokens": tokens,
            "lengths": lengths,
            "caption_counts": [len(s["captions"]) for s in samples],
        }

    # ------------------------------------------------------------------ losses and evaluation

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        return {name: batch[name] for name in ("regions", "mask", "tokens", "lengths")}

    def losses(self, out: dict, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        # Each term is this rank's share of the global batch's loss (see losses/distributed.py).
        cross = self.cross_batch_losses(out, batch)
        own = self.micro_batch_losses(out, batch)
        return {**cross, **own, "loss": cross["loss"] + own["loss"] if own else cross["loss"]}

    # train.accumulate_negatives (recipes/capabilities.py, CachesNegatives): L_M over the global
    # batch from cached embeddings; L_G, a mean over captions (or tokens), per micro-batch: exact.

    def negatives_refusal(self) -> str:
        return ""

    def cross_batch_embeddings(self, out: dict) -> dict[str, torch.Tensor]:
        return {"image": out["image"], "text": out["text"]}

    def joined_batch(self, batches: list[dict]) -> dict:
        return joined_rows(batches, "identity")

    def cross_batch_losses(self, embeddings: dict, batch: dict) -> dict[str, torch.Tensor]:
        matching = cross_rank_vse_hinge_loss(
            embeddings["image"],
            embeddings["text"],
            self.cfg.margin,
            self.hardest_negatives,
            self.cfg.gather_negatives,
            batch.get("identity"),
        )
        return {"loss": matching, "matching": matching.detach()}

    def micro_batch_losses(self, out: dict, batch: dict) -> dict[str, torch.Tensor]:
        if "caption_logits" not in out:
            return {}
        nll = cross_rank_caption_nll if self.cfg.caption_loss_reduction == "caption" else cross_rank_token_nll
        caption = nll(out["caption_logits"], batch["tokens"][:, 1:], self.vocab.pad_id)
        return {"loss": self.cfg.caption_loss_weight * caption, "caption": caption.detach()}

    def micro_batch_weight(self, batch: dict) -> int:
        targets = batch["tokens"][:, 1:]
        return (
            targets.shape[0]
            if self.cfg.caption_loss_reduction == "caption"
            else int((targets != self.vocab.pad_id).sum())
        )

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> dict:
        was_training = model.training
        model.eval()
        images, captions, counts = [], [], []
        for batch in batches:
            images.append(model.embed_images(batch["regions"].to(device), batch["mask"].to(device)).float().cpu())
            captions.append(model.embed_captions(batch["tokens"].to(device), batch["lengths"].to(device)).float().cpu())
            counts.extend(batch["caption_counts"])
        model.train(was_training)
        if not images:
            raise RuntimeError("the evaluation split yielded no samples (all missing or corrupt?)")
        sims = torch.cat(images) @ torch.cat(captions).T
        caption_images = np.repeat(np.arange(len(counts)), counts)  # captions come image by image
        result = retrieval_protocols(sims, fold_size=self.config.eval.fold_size, caption_images=caption_images)
        result.update(
            n_images=len(counts), n_captions=int(sum(counts)), chance=chance_recall(len(counts), caption_counts=counts)
        )
        return result

    @classmethod
    def headline(cls, metrics: dict) -> dict[str, float]:
        full = metrics["full"]
        return {k: full[k] for k in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")}

    def selection_score(self, metrics: dict) -> float:
        return metrics["full"]["rsum"]  # as VSRN's code: the best epoch by validation rsum

    @classmethod
    def report(cls, rows: dict[str, dict], split: str) -> str:
        last = list(rows.values())[-1]
        table = {"chance": last["chance"], **{name: cls.headline(m) for name, m in rows.items()}}
        return retrieval_report(table, last, split)
