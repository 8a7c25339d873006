"""Two-branch networks (Wang, Li & Lazebnik, TPAMI) for image-sentence retrieval.

two_branch_embed  the embedding network: both branches into one space, the bi-directional top-K
                  ranking loss with the neighbourhood constraint (losses/two_branch.py)
two_branch_sim    the similarity network: the same branches, their element-wise product through
                  fusion layers to one logit, logistic loss on balanced positive and negative pairs

Images are one vector each: the shard's first region row (synth: the whole image) or the mean of
its rows. Sentences are tf-idf vectors (scikit-learn, fitted on the train captions; the paper's
HGLMM Fisher vectors need downloads) or a learned mean of word vectors. Neighbourhood sampling
is `model.sentences_per_image` >= 2: each image of a batch brings that many of its captions, so
every batch holds at least two sentences of each of its images, on any number of ranks and
loader workers, streamed, with the equal steps the pipeline already gives every rank.
Paper: ../shared/papers/two-branch-networks.txt; notes: ../shared/papers/notes-two-branch.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from math import comb
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vldist.config import Section
from vldist.data.collate import pad_tokens
from vldist.data.samples import read_meta, read_regions, require_region_features
from vldist.data.shardset import ShardSet
from vldist.distributed.collectives import all_gather_rows, all_gather_with_grad
from vldist.losses.negatives import draw_negatives, step_generator
from vldist.losses.two_branch import cross_rank_two_branch_ranking_loss
from vldist.metrics import retrieval_protocols, sentence_to_sentence_recall
from vldist.models.two_branch import TwoBranchModel
from vldist.recipes.base import Recipe
from vldist.recipes.captioner import unwrap
from vldist.report import chance_recall, retrieval_report

FUSION_WIDTHS = (512, 256)  # the paper's fusion layers: FC 512x512, ReLU, FC 512x256, ReLU, FC 256x1


class TwoBranchConfig(Section):
    image_feature: Literal["whole", "mean"] = Field(
        "whole", description="image vector: the first region row (synth: the whole image) or the mean of the rows")
    text_features: Literal["tfidf", "mean_words"] = Field(
        "tfidf", description="sentence input: tf-idf fitted on the train captions, or a learned mean of word vectors")
    word_dim: int = Field(300, ge=1, description="text_features=mean_words: word vector size")
    hidden: int = Field(2048, ge=1, description="each branch's first FC width (paper: 2048)")
    embed: int = Field(512, ge=1, description="each branch's output width (paper: 512)")
    nonlinear: bool = Field(True, description="FC-ReLU-dropout-FC branches; False: one linear layer (Table 2's linear rows)")
    dropout: float = Field(0.5, ge=0, lt=1, description="after the branches' ReLU (paper: 0.5)")
    batchnorm: Literal["last", "first", "none"] = Field(
        "last", description="batch norm after the last FC (paper) or after the first, before the ReLU (official code)")
    sentences_per_image: int = Field(
        2, ge=1, description="captions each image brings to a batch: >= 2 is neighbourhood sampling, 1 turns it off")


class TwoBranchEmbedConfig(TwoBranchConfig):
    margin: float = Field(0.1, ge=0, description="ranking margin m (paper: 0.1; official code: 0.05)")
    top_k: int = Field(50, ge=1, description="violators per (anchor, positive) pair (paper: 50; official code: 10)")
    lambda_image: float = Field(1.0, ge=0, description="image-anchor term (0: single-directional, Table 2)")
    lambda_text: float = Field(2.0, ge=0, description="sentence-anchor term (paper: 2)")
    lambda_text_neighbors: float = Field(0.0, ge=0, description="neighbourhood constraint on sentences (paper: 0.2)")
    gather_negatives: bool = Field(True, description="violators from the global batch (all ranks); False: each rank's slice")


class TwoBranchSimConfig(TwoBranchConfig):
    fusion_layers: int = Field(3, ge=1, le=3, description="FC layers after the product (paper: 3 = 512-512-256-1)")
    negatives_per_positive: int = Field(
        1, ge=1, description="non-matching sentences drawn per positive pair (paper: 1, balanced classes)")


class TwoBranchRecipe(Recipe):
    """What both networks share: samples, batches, the model, evaluation and the report."""

    sample_keys = ("json", "regions.npy")
    network: str

    @property
    def cfg(self) -> TwoBranchConfig:
        return self.config.model

    def build_model(self) -> nn.Module:
        image_dim = require_region_features(self.feature_dim, self.config.data.shards, self.name)
        cfg = self.cfg
        fusion = FUSION_WIDTHS[len(FUSION_WIDTHS) - cfg.fusion_layers + 1:] if self.network == "similarity" else None
        return TwoBranchModel(image_dim, len(self.vocab), cfg.text_features, cfg.word_dim, cfg.hidden, cfg.embed,
                              cfg.nonlinear, cfg.dropout, cfg.batchnorm, fusion)

    def initialize(self, model: nn.Module) -> None:
        if self.cfg.text_features == "tfidf":  # saved in the checkpoint as the `idf` buffer
            model.text_features.fit(self.vocab, ShardSet.open(self.config.data.shards).train_captions())

    # ------------------------------------------------------------------ samples and batches

    def _image(self, raw: dict) -> np.ndarray:
        regions = read_regions(raw, self.feature_dim)
        return regions[0] if self.cfg.image_feature == "whole" else regions.mean(0)

    def _tokens(self, caption: str) -> list[int]:
        return self.vocab.encode(caption, self.config.data.max_caption_len)

    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        captions = read_meta(raw)["captions"]
        chosen = rng.sample(captions, min(self.cfg.sentences_per_image, len(captions)))
        return {"image": self._image(raw), "captions": [self._tokens(c) for c in chosen]}

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        captions = read_meta(raw)["captions"][: self.config.eval.max_captions_per_image]
        return {"key": raw["__key__"], "image": self._image(raw), "captions": [self._tokens(c) for c in captions]}

    def _collate(self, samples: list[dict]) -> dict:
        images = torch.from_numpy(np.stack([s["image"] for s in samples]).astype(np.float32))
        length = self.config.data.max_caption_len if self.uniform_shapes else None
        tokens, _ = pad_tokens([c for s in samples for c in s["captions"]], length=length)
        counts = [len(s["captions"]) for s in samples]
        return {"images": images, "tokens": tokens, "caption_counts": counts,
                "text_image": torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(counts))}

    def collate_train(self, samples: list[dict]) -> dict:
        return self._collate(samples)

    def collate_eval(self, samples: list[dict]) -> dict:
        return {**self._collate(samples), "keys": [s["key"] for s in samples]}

    # ------------------------------------------------------------------ evaluation

    def scores(self, model: nn.Module, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """(n_images x n_sentences) retrieval scores from the branches' outputs."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[dict], device: torch.device,
                 validation: bool = False) -> dict:
        was_training = model.training
        model.eval()
        net = unwrap(model)
        images, texts, counts = [], [], []
        for batch in batches:
            images.append(net.embed_images(batch["images"].to(device)))
            texts.append(net.embed_captions(batch["tokens"].to(device)))
            counts.extend(batch["caption_counts"])
        if not images:
            model.train(was_training)
            raise RuntimeError("the evaluation split yielded no samples (all missing or corrupt?)")
        image, text = torch.cat(images), torch.cat(texts)
        sims = self.scores(net, image, text).float().cpu()
        model.train(was_training)
        caption_images = np.repeat(np.arange(len(counts)), counts)  # captions come image by image
        result = retrieval_protocols(sims, fold_size=self.config.eval.fold_size, caption_images=caption_images)
        result.update(n_images=len(counts), n_captions=int(sum(counts)),
                      chance=chance_recall(len(counts), caption_counts=counts))
        if self.network == "embedding":  # sentences embedded in one space can query each other
            text = text.float().cpu()
            result["sentence_to_sentence"] = sentence_to_sentence_recall(text @ text.T, caption_images)
            result["chance"]["s2s_r1"] = sentence_chance(counts, 1)
        return result

    def headline(self, metrics: dict) -> dict[str, float]:
        full = metrics["full"]
        out = {k: full[k] for k in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")}
        if "sentence_to_sentence" in metrics:
            out["s2s_r1"] = metrics["sentence_to_sentence"]["r1"]
        return out

    def selection_score(self, metrics: dict) -> float:
        return metrics["full"]["rsum"]

    def report(self, rows: dict[str, dict], split: str) -> str:
        last = list(rows.values())[-1]
        table = {"chance": last["chance"], **{name: self.headline(m) for name, m in rows.items()}}
        text = retrieval_report(table, last, split)
        if "sentence_to_sentence" in last:
            text += "\nsentence-to-sentence R@1 (a sentence finds another of its image, itself excluded): " + ", ".join(
                f"{name} {m['s2s_r1']:.1f}" for name, m in table.items())
        return text


def sentence_chance(counts: list[int], k: int) -> float:
    """Expected sentence-to-sentence R@k (percent) of a random ranking: a query of an image with c
    sentences finds one of its c - 1 neighbours in the top k of the M - 1 others (queries
    without a neighbour left out, as the metric does)."""
    m = sum(counts)
    rates = [1 - comb(m - c, k) / comb(m - 1, k) for c in counts if c >= 2 for _ in range(c)]
    return 100 * sum(rates) / len(rates) if rates else 0.0


class TwoBranchEmbedRecipe(TwoBranchRecipe):
    name = "two_branch_embed"
    description = "two-branch embedding network: bi-directional top-K ranking with neighbourhood constraints"
    ModelConfig = TwoBranchEmbedConfig
    network = "embedding"

    def losses(self, model: nn.Module, batch: dict, update: str = "main") -> dict[str, torch.Tensor]:
        cfg = self.cfg
        out = model(batch["images"], batch["tokens"])
        loss = cross_rank_two_branch_ranking_loss(
            out["image"], out["text"], batch["text_image"], cfg.margin, cfg.top_k, cfg.lambda_image,
            cfg.lambda_text, cfg.lambda_text_neighbors, cfg.gather_negatives)
        return {"loss": loss}

    def scores(self, model, images, texts):
        # On normalised embeddings, -|x - y| ranks as x.y does (|x - y|^2 = 2 - 2 x.y).
        return images @ texts.T


class TwoBranchSimRecipe(TwoBranchRecipe):
    name = "two_branch_sim"
    description = "two-branch similarity network: element-wise product, fusion layers, logistic loss"
    ModelConfig = TwoBranchSimConfig
    network = "similarity"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step, self._micro = 0, 0

    def updates(self, step: int) -> tuple[str, ...]:
        self._step, self._micro = step, 0
        return ("main",)

    def losses(self, model: nn.Module, batch: dict, update: str = "main") -> dict[str, torch.Tensor]:
        """Eq. 7, sum of log(1 + exp(-z p)): each sentence with its image (z = +1) and with
        `negatives_per_positive` sentences of other images drawn from the global batch (z = -1).
        This rank's share: its own pairs; the draw is the same on every rank (same seed, same
        global ids), so W ranks sum to one process on the whole batch."""
        out = model(batch["images"], batch["tokens"])
        image, text, rows = out["image"], out["text"], batch["text_image"].to(out["image"].device)
        all_text, offset = all_gather_with_grad(text)
        counts, first = all_gather_rows(torch.tensor([image.shape[0]], device=image.device))
        all_ids = all_gather_rows(rows + int(counts[:first].sum()))[0]
        generator = step_generator(self.config.seed, self._step, self._micro)
        self._micro += 1
        draw = draw_negatives(all_ids, self.cfg.negatives_per_positive, generator)[:, offset:offset + len(rows)]
        net = unwrap(model)
        pairs = net.pair_scores(image[rows].repeat(draw.shape[0] + 1, 1), torch.cat([text, all_text[draw.flatten()]]))
        positive, negative = pairs[:len(rows)], pairs[len(rows):]
        loss = F.softplus(-positive.float()).sum() + F.softplus(negative.float()).sum()
        return {"loss": loss, "positive_logit": positive.detach().mean(), "negative_logit": negative.detach().mean()}

    def scores(self, model, images, texts):
        return model.all_pair_scores(images, texts)
