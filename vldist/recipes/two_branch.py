"""Two-branch networks (Wang, Li & Lazebnik, TPAMI) for image-sentence retrieval and phrase
localisation.

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

`model.tasks` picks the tasks: `retrieval` (images and their captions), `phrases` (object
phrases and proposal regions, data/phrases.py), or both: then one job trains a model for each
(stages: <output.dir>/retrieval, <output.dir>/phrases) and prints both.
Paper: ../shared/papers/two-branch-networks.txt; notes: ../shared/papers/notes-two-branch.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from math import comb
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vldist.config import JobConfig, Section, updated
from vldist.data import phrases as phrase_data
from vldist.data.collate import concat_rows, pad_tokens
from vldist.data.samples import read_meta, read_regions, require_region_features
from vldist.data.shardset import ShardSet
from vldist.distributed.collectives import all_gather_rows, all_gather_with_grad
from vldist.errors import ShardsUnfitError
from vldist.losses.negatives import draw_negatives, step_generator
from vldist.losses.not_negative import local_identities
from vldist.losses.two_branch import cross_rank_phrase_ranking_loss, cross_rank_two_branch_ranking_loss
from vldist.metrics import phrase_localization_recall, retrieval_protocols, sentence_to_sentence_recall
from vldist.metrics.report import chance_recall, retrieval_report
from vldist.models.two_branch import TwoBranchModel
from vldist.recipes.base import Recipe, unwrap
from vldist.recipes.capabilities import joined_rows

ALL_POSITIVES = (
    "phrases with augmented_positives: every proposal of IoU >= 0.7 a positive pair of its own, each with its "
    "drawn negatives (Algorithm 1, similarity network); False: one at random per visit (embedding network)"
)
FUSION_WIDTHS = (512, 256)  # the paper's fusion layers: FC 512x512, ReLU, FC 512x256, ReLU, FC 256x1


class TwoBranchConfig(Section):
    image_feature: Literal["whole", "mean"] = Field(
        "whole", description="image vector: the first region row (synth: the whole image) or the mean of the rows"
    )
    text_features: Literal["tfidf", "mean_words"] = Field(
        "tfidf", description="sentence input: tf-idf fitted on the train captions, or a learned mean of word vectors"
    )
    word_dim: int = Field(300, ge=1, description="text_features=mean_words: word vector size")
    hidden: int = Field(2048, ge=1, description="each branch's first FC width (paper: 2048)")
    embed: int = Field(512, ge=1, description="each branch's output width (paper: 512)")
    nonlinear: bool = Field(
        True, description="FC-ReLU-dropout-FC branches; False: one linear layer (Table 2's linear rows)"
    )
    dropout: float = Field(0.5, ge=0, lt=1, description="retrieval: after the branches' ReLU (paper §5: 0.5)")
    phrase_dropout: float = Field(
        0.0, ge=0, lt=1, description="phrases: dropout after the branches' ReLU (paper §5.3: none for phrases)"
    )
    phrase_weight_decay: float = Field(
        0.005, ge=0, description="phrases: the stage's train.weight_decay (paper §4.3: 0.005 in all FC layers)"
    )
    batchnorm: Literal["last", "first", "none"] = Field(
        "last", description="batch norm after the last FC (paper) or after the first, before the ReLU (official code)"
    )
    sentences_per_image: int = Field(
        2, ge=1, description="captions each image brings to a batch: >= 2 is neighbourhood sampling, 1 turns it off"
    )
    tasks: list[Literal["retrieval", "phrases"]] = Field(
        ["retrieval"], min_length=1, description="retrieval, phrases (phrase localisation) or both: a model each"
    )
    augmented_positives: bool = Field(
        True,
        description="phrases: a random proposal of IoU >= 0.7 as the positive (paper); False: the box's own region",
    )
    all_positives: bool = Field(False, description=ALL_POSITIVES)
    phrase_negatives: Annotated[int, Field(ge=0)] | Literal["all"] = Field(
        1,
        description="phrases: negative regions drawn per phrase and visit, proposals of its image with IoU < 0.3 "
        "with its box (and its chain's); all: every one (paper, embedding network)",
    )


class TwoBranchEmbedConfig(TwoBranchConfig):
    margin: float = Field(0.1, ge=0, description="ranking margin m (paper: 0.1; official code: 0.05)")
    top_k: int = Field(50, ge=1, description="violators per (anchor, positive) pair (paper: 50; official code: 10)")
    lambda_image: float = Field(1.0, ge=0, description="image-anchor term (0: single-directional, Table 2)")
    lambda_text: float = Field(2.0, ge=0, description="sentence-anchor term (paper: 2)")
    lambda_text_neighbors: float = Field(0.0, ge=0, description="neighbourhood constraint on sentences (paper: 0.2)")
    gather_negatives: bool = Field(
        True, description="violators from the global batch (all ranks); False: each rank's slice"
    )
    phrase_negatives: Annotated[int, Field(ge=0)] | Literal["all"] = Field(
        "all",
        description="phrases: negative regions drawn per phrase and visit, proposals of its image with IoU < "
        "0.3 with its box (and its chain's); all: every one, the top-K violators among them (paper)",
    )
    phrase_negatives_from: Literal["image", "batch"] = Field(
        "image",
        description="phrases: a phrase's negative regions are its image's (paper), or also every region of "
        "the batch's other images (batch)",
    )
    phrase_top_k: int = Field(30, ge=1, description="phrases: violators per pair (paper: 30)")
    phrase_lambda_image: float = Field(
        1.0, ge=0, description="phrases: region-anchor term, the batch's phrases of other chains negative (paper: 1)"
    )
    phrase_lambda_text: float = Field(
        4.0, ge=0, description="phrases: phrase-anchor term, its negative regions negative (paper: 4)"
    )


class TwoBranchSimConfig(TwoBranchConfig):
    all_positives: bool = Field(True, description=ALL_POSITIVES)
    fusion_layers: int = Field(3, ge=1, le=3, description="FC layers after the product (paper: 3 = 512-512-256-1)")
    negatives_per_positive: int = Field(
        1, ge=1, description="non-matching sentences drawn per positive pair (paper: 1, balanced classes)"
    )


class TwoBranchRecipe(Recipe):
    """What both networks share: samples, batches, the model, evaluation and the report."""

    network: str

    @property
    def cfg(self) -> TwoBranchConfig:
        return self.config.model

    @property
    def sample_keys(self) -> tuple[str, ...]:
        return ("json", "regions.npy", *(("proposals.npy",) if "phrases" in self.cfg.tasks else ()))

    @classmethod
    def stages(cls, config: JobConfig) -> list[tuple[str, JobConfig]]:
        """One run per task, as the paper trains one model per task (shared branches trained on
        both at once did worse at retrieval: whole images and proposal regions are different
        inputs to one image branch and its batch norm)."""
        return [(task, updated(config, cls._task_settings(config, task))) for task in config.model.tasks]

    @staticmethod
    def _task_settings(config: JobConfig, task: str) -> dict:
        """The phrase stage's own regularisation (paper §4.3 and §5.3: weight decay 0.005, no
        dropout), so that one job trains both tasks with the paper's settings for each."""
        if task != "phrases":
            return {"model": {"tasks": [task]}}
        cfg = config.model
        return {
            "model": {"tasks": [task], "dropout": cfg.phrase_dropout},
            "train": {"weight_decay": cfg.phrase_weight_decay},
        }

    def build_model(self) -> nn.Module:
        image_dim = require_region_features(self.feature_dim, self.config.data.shards, self.name)
        cfg = self.cfg
        fusion = FUSION_WIDTHS[len(FUSION_WIDTHS) - cfg.fusion_layers + 1 :] if self.network == "similarity" else None
        return TwoBranchModel(
            image_dim,
            len(self.vocab),
            cfg.text_features,
            cfg.word_dim,
            cfg.hidden,
            cfg.embed,
            cfg.nonlinear,
            cfg.dropout,
            cfg.batchnorm,
            fusion,
        )

    def checkpointed_blocks(self, model: TwoBranchModel) -> list[nn.Module]:
        """Both branches and the similarity network's fusion layers (which score every drawn pair)."""
        return [model.image, model.text, *([model.fusion] if model.fusion is not None else [])]

    def preflight(self, shards: ShardSet) -> None:
        if "phrases" not in self.cfg.tasks:
            return
        if not shards.manifest.get("features", {}).get("proposals"):
            raise ShardsUnfitError(
                f"the shard set {shards.directory} has no proposals, and model.tasks includes phrases (phrase "
                "localisation ranks proposal boxes by their features). Build the set again with them "
                f"(python -m vldist.shards synth --out {shards.directory} --overwrite; converters: --proposals), "
                "or set model.tasks=[retrieval]"
            )

    def initialize(self, model: nn.Module, start, shards) -> None:
        if self.cfg.text_features == "tfidf":  # saved in the checkpoint as the `idf` buffer
            model.text_features.fit(self.vocab, shards.main.train_captions())

    @classmethod
    def train_streams(cls, config: JobConfig) -> dict[str, str]:
        return {task: config.data.train_split for task in config.model.tasks}

    def stream_functions(self, stream: str):
        if stream == "phrases":
            return self.phrase_sample, self.collate_phrases
        return self.train_sample, self.collate_train

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

    def phrase_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        proposals, boxes = phrase_data.read_proposals(raw, meta, self.feature_dim)
        image = phrase_data.training_image(
            meta,
            read_regions(raw, self.feature_dim),
            proposals,
            boxes,
            rng,
            self.cfg.augmented_positives,
            self.cfg.phrase_negatives,
            every_positive=self.cfg.all_positives,
        )
        return {**image, "phrases": [self._tokens(p) for p in image["phrases"]]}

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        captions = meta["captions"][: self.config.eval.max_captions_per_image]
        sample = {"key": raw["__key__"], "image": self._image(raw), "captions": [self._tokens(c) for c in captions]}
        if "phrases" in self.cfg.tasks:
            proposals, boxes = phrase_data.read_proposals(raw, meta, self.feature_dim)
            objects = phrase_data.phrase_objects(meta)
            sample.update(
                proposals=proposals,
                proposal_boxes=boxes,
                gt_boxes=[o["box"] for o in objects],
                phrases=[self._tokens(o["phrase"]) for o in objects],
            )
        return sample

    def _collate(self, samples: list[dict]) -> dict:
        images = torch.from_numpy(np.stack([s["image"] for s in samples]).astype(np.float32))
        tokens, _ = pad_tokens([c for s in samples for c in s["captions"]], length=self._length())
        counts = [len(s["captions"]) for s in samples]
        return {
            "images": images,
            "tokens": tokens,
            "caption_counts": counts,
            "text_image": torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(counts)),
        }

    def _length(self) -> int | None:
        return self.config.data.max_caption_len if self.uniform_shapes else None

    def collate_train(self, samples: list[dict]) -> dict:
        return self._collate(samples)

    def collate_phrases(self, samples: list[dict]) -> dict:
        """Samples of data/phrases.py's `training_image`, one per image, as one batch:

        images, tokens     the region rows (each phrase's positive, in phrase order, then each
                           image's negative pool) and the phrases
        text_image         (M,) each phrase's positive row (= its own index)
        phrase_sample      (M,) each phrase's sample (image) in the batch; region_sample (R,)
        phrase_entity      (M,) its coreference chain, numbered within its image
        phrase_box, region_box  (M, 4), (R, 4) the boxes
        negative_rows      (N,) the pool rows, whatever phrase they were drawn for
        drawn_negatives    (2, D) (phrase, region row): the regions drawn for each phrase
        region_negatives   (2, Q) (phrase, region row): every region of its image that is a
                           negative of the phrase (IoU < 0.3 with its chain's boxes)
        phrase_negatives   (2, Q') (phrase m, phrase k) of one image: k a negative of m's positive
                           region (another chain, and the region is no positive of k)
        """
        phrases = [len(s["phrases"]) for s in samples]
        pools = [len(s["negatives"]) for s in samples]
        total = sum(phrases)
        if not total:
            raise ValueError("a phrase batch without phrases: its images have no objects with a phrase and a box")
        phrase_start = np.cumsum([0, *phrases])[:-1]
        pool_start = total + np.cumsum([0, *pools])[:-1]

        def stack(key: str, width: int) -> torch.Tensor:
            return torch.from_numpy(
                np.concatenate([np.asarray(s[key], dtype=np.float32).reshape(-1, width) for s in samples])
            )

        def pairs(key: str, column_start) -> torch.Tensor:
            listed = [s[key] + [p, c] for s, p, c in zip(samples, phrase_start, column_start, strict=True)]
            return torch.from_numpy(np.concatenate(listed).astype(np.int64).reshape(-1, 2)).T.contiguous()

        dim = samples[0]["positive"].shape[1]
        sample_index = torch.arange(len(samples))
        phrase_sample = torch.repeat_interleave(sample_index, torch.tensor(phrases))
        tokens, _ = pad_tokens([p for s in samples for p in s["phrases"]], length=self._length())
        return {
            "images": concat_rows([s["positive"] for s in samples] + [s["negatives"] for s in samples], dim),
            "tokens": tokens,
            "text_image": torch.arange(total),
            "phrase_sample": phrase_sample,
            "region_sample": torch.cat([phrase_sample, torch.repeat_interleave(sample_index, torch.tensor(pools))]),
            "phrase_entity": torch.from_numpy(np.concatenate([s["entity"] for s in samples]).astype(np.int64)),
            "phrase_box": stack("box", 4),
            "region_box": torch.cat([stack("positive_box", 4), stack("negative_box", 4)]),
            "negative_rows": torch.arange(total, total + sum(pools)),
            "drawn_negatives": pairs("drawn", pool_start),
            "region_negatives": pairs("region_negatives", pool_start),
            "phrase_negatives": pairs("phrase_negatives", phrase_start),
        }

    def collate_eval(self, samples: list[dict]) -> dict:
        batch = {**self._collate(samples), "keys": [s["key"] for s in samples]}
        if "phrases" in self.cfg.tasks:
            for name in ("proposals", "proposal_boxes", "gt_boxes", "phrases"):
                batch[name] = [s[name] for s in samples]
        return batch

    # ------------------------------------------------------------------ losses

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        return {"images": batch["images"], "tokens": batch["tokens"]}

    def losses(self, out: dict, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        if batch.get("stream", "retrieval") == "phrases":
            return {"loss": self.phrase_loss(model, out, batch)}
        return self.retrieval_loss(model, out, batch)

    # ------------------------------------------------------------------ evaluation

    def scores(self, model: nn.Module, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """(n_images x n_sentences) scores from the branches' outputs, higher is better."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> dict:
        was_training = model.training
        model.eval()
        net = unwrap(model)
        images, texts, counts, phrases = [], [], [], {"scores": [], "boxes": [], "gt": [], "iou": []}
        for batch in batches:
            counts.extend(batch["caption_counts"])
            if "retrieval" in self.cfg.tasks:
                images.append(net.embed_images(batch["images"].to(device)))
                texts.append(net.embed_captions(batch["tokens"].to(device)))
            if "phrases" in self.cfg.tasks:
                self._score_phrases(net, batch, device, phrases)
        model.train(was_training)
        if not counts:
            raise RuntimeError("the evaluation split yielded no samples (all missing or corrupt?)")
        result: dict = {"n_images": len(counts), "n_captions": int(sum(counts))}
        if "retrieval" in self.cfg.tasks:
            result.update(self._retrieval_metrics(net, torch.cat(images), torch.cat(texts), counts))
        if "phrases" in self.cfg.tasks:
            recall = phrase_localization_recall(phrases["scores"], phrases["boxes"], phrases["gt"])
            recall["chance"] = {f"r{k}": phrase_data.random_ranking_recall(phrases["iou"], k) for k in (1, 5, 10)}
            result["phrases"] = recall
        return result

    def _retrieval_metrics(self, net: nn.Module, image: torch.Tensor, text: torch.Tensor, counts: list[int]) -> dict:
        sims = self.scores(net, image, text).float().cpu()
        caption_images = np.repeat(np.arange(len(counts)), counts)  # captions come image by image
        result = retrieval_protocols(sims, fold_size=self.config.eval.fold_size, caption_images=caption_images)
        result["chance"] = chance_recall(len(counts), caption_counts=counts)
        if self.network == "embedding":  # sentences embedded in one space can query each other
            text = text.float().cpu()
            result["sentence_to_sentence"] = sentence_to_sentence_recall(text @ text.T, caption_images)
            result["chance"]["s2s_r1"] = sentence_chance(counts, 1)
        return result

    def _score_phrases(self, net: nn.Module, batch: dict, device: torch.device, into: dict) -> None:
        """Each phrase against every proposal of its own image. Each branch runs once per batch
        (all its images' proposals, all its phrases); only the scoring goes image by image."""
        proposals = [torch.as_tensor(p).float() for p in batch["proposals"]]  # the loader made them tensors
        phrases = [t for tokens in batch["phrases"] for t in tokens]
        if not phrases:
            return
        regions = net.embed_images(torch.cat(proposals).to(device)).split([len(p) for p in proposals])
        queries = net.embed_captions(pad_tokens(phrases)[0].to(device)).split([len(t) for t in batch["phrases"]])
        for image_regions, image_queries, boxes, gt in zip(
            regions, queries, batch["proposal_boxes"], batch["gt_boxes"], strict=True
        ):
            if not len(image_queries):
                continue
            scores = self.scores(net, image_queries, image_regions).float().cpu()  # (phrases, proposals)
            into["scores"] += list(scores)
            into["boxes"] += [boxes] * len(image_queries)
            into["gt"] += gt
            into["iou"] += list(phrase_data.overlaps(gt, boxes))

    @classmethod
    def headline(cls, metrics: dict) -> dict[str, float]:
        out = {}
        if "full" in metrics:
            full = metrics["full"]
            out = {k: full[k] for k in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")}
        if "sentence_to_sentence" in metrics:
            out["s2s_r1"] = metrics["sentence_to_sentence"]["r1"]
        if "phrases" in metrics:
            out.update({f"phrase_r{k}": metrics["phrases"][f"r{k}"] for k in (1, 5, 10)})
        return out

    def selection_score(self, metrics: dict) -> float:
        """rsum, plus phrase R@1 + R@5 + R@10 when phrases are a task."""
        score = metrics["full"]["rsum"] if "full" in metrics else 0.0
        if "phrases" in metrics:
            score += sum(metrics["phrases"][f"r{k}"] for k in (1, 5, 10))
        return score

    @classmethod
    def report(cls, rows: dict[str, dict], split: str) -> str:
        """A retrieval table and a phrase table, each over the rows that have its task (a job of
        both tasks has one stage each: untrained, retrieval, phrases)."""
        lines = []
        retrieval = {name: m for name, m in rows.items() if "full" in m}
        if retrieval:
            last = list(retrieval.values())[-1]
            table = {"chance": last["chance"], **{name: cls.headline(m) for name, m in retrieval.items()}}
            lines.append(retrieval_report(table, last, split))
            if "sentence_to_sentence" in last:
                lines.append(
                    "sentence-to-sentence R@1 (a sentence finds another of its image, itself excluded): "
                    + ", ".join(f"{name} {m['s2s_r1']:.1f}" for name, m in table.items())
                )
        phrases = {name: m["phrases"] for name, m in rows.items() if "phrases" in m}
        if phrases:
            last = list(phrases.values())[-1]
            lines.append(
                f"phrase localisation: {last['n_phrases']} phrases, each ranking its image's proposals "
                f"(IoU >= 0.5 is a hit; {last['upper_bound']:.1f}% of the phrases have one)"
            )
            lines.append(f"{'':<12}{'R@1':>8}{'R@5':>8}{'R@10':>8}")
            lines += [
                f"{name:<12}" + "".join(f"{m[f'r{k}']:>8.1f}" for k in (1, 5, 10))
                for name, m in {"chance": last["chance"], **phrases}.items()
            ]
        return "\n".join(lines)


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

    def retrieval_loss(self, model, out, batch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        loss = cross_rank_two_branch_ranking_loss(
            out["image"],
            out["text"],
            batch["text_image"],
            cfg.margin,
            cfg.top_k,
            cfg.lambda_image,
            cfg.lambda_text,
            cfg.lambda_text_neighbors,
            cfg.gather_negatives,
            batch.get("identity"),
        )
        return {"loss": loss}

    # train.accumulate_negatives (recipes/capabilities.py, CachesNegatives): the ranking loss over
    # the global batch from cached embeddings, exact; nothing per micro-batch.

    def negatives_refusal(self) -> str:
        if "phrases" in self.cfg.tasks:
            return (
                "phrase localisation (model.tasks includes phrases) ranks each phrase against its image's regions "
                "drawn per micro-batch and the batch's phrases by coreference chain, which are not cached; it is "
                "built for retrieval only (model.tasks=[retrieval])"
            )
        return ""

    def cross_batch_embeddings(self, out: dict) -> dict[str, torch.Tensor]:
        return {"image": out["image"], "text": out["text"]}

    def joined_batch(self, batches: list[dict]) -> dict:
        """text_image counts image rows within its micro-batch: offset by the images before it."""
        offsets = np.cumsum([0, *(b["images"].shape[0] for b in batches)])[:-1]
        text_image = torch.cat([b["text_image"] + int(o) for b, o in zip(batches, offsets, strict=True)])
        return {"text_image": text_image, **joined_rows(batches, "identity")}

    def cross_batch_losses(self, embeddings: dict, batch: dict) -> dict[str, torch.Tensor]:
        return self.retrieval_loss(None, embeddings, batch)

    def micro_batch_losses(self, out: dict, batch: dict) -> dict[str, torch.Tensor]:
        return {}

    def micro_batch_weight(self, batch: dict) -> int:
        return 1  # no per-micro-batch terms to weigh

    def phrase_loss(self, model, out, batch) -> torch.Tensor:
        """Algorithm 1 of the paper (losses/two_branch.py, `phrase_ranking_loss`): each phrase's
        positive region ranks the batch's phrases of other chains, each phrase ranks the negative
        regions of its image (`phrase_negatives_from=batch`: and every region of the batch's other
        images); no neighbourhood term."""
        cfg = self.cfg
        return cross_rank_phrase_ranking_loss(
            out["image"],
            out["text"],
            batch["text_image"],
            batch["phrase_sample"],
            batch["region_sample"],
            batch["region_negatives"],
            batch["phrase_negatives"],
            batch.get("identity"),
            margin=cfg.margin,
            top_k=cfg.phrase_top_k,
            lambda_image=cfg.phrase_lambda_image,
            lambda_text=cfg.phrase_lambda_text,
            negatives_from=cfg.phrase_negatives_from,
            gather=cfg.gather_negatives,
        )

    def scores(self, model, images, texts):
        # On normalised embeddings, -|x - y| ranks as x.y does (|x - y|^2 = 2 - 2 x.y).
        return images @ texts.T


class TwoBranchSimRecipe(TwoBranchRecipe):
    name = "two_branch_sim"
    description = "two-branch similarity network: element-wise product, fusion layers, logistic loss"
    ModelConfig = TwoBranchSimConfig
    network = "similarity"
    accumulate_negatives_refusal = (
        "its loss draws non-matching pairs from the global batch and scores each through the fusion layers, "
        "whose own gradients a cache of the branches' embeddings would not carry; use two_branch_embed, whose "
        "ranking loss reads the embeddings alone"
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step, self._micro = 0, 0

    def start_step(self, step: int) -> None:
        self._step, self._micro = step, 0

    def retrieval_loss(self, model, out, batch) -> dict[str, torch.Tensor]:
        """Eq. 7, sum of log(1 + exp(-z p)): each sentence with its image (z = +1) and with
        `negatives_per_positive` sentences of other images drawn from the global batch (z = -1;
        never a sentence of another copy of the same image).
        This rank's share: its own pairs; the draw is the same on every rank (same seed, same
        global ids), so W ranks sum to one process on the whole batch."""
        image, text, rows = out["image"], out["text"], batch["text_image"].to(out["image"].device)
        all_text, offset = all_gather_with_grad(text)
        # each sentence's image identity: a copy of its image elsewhere in the batch is no negative
        identity = local_identities(batch.get("identity"), image.shape[0], image.device)
        all_ids = all_gather_rows(identity[rows])[0]
        generator = step_generator(self.config.seed, self._step, self._micro)
        self._micro += 1
        draw = draw_negatives(all_ids, self.cfg.negatives_per_positive, generator)[:, offset : offset + len(rows)]
        pairs = model.pair_scores(image[rows].repeat(draw.shape[0] + 1, 1), torch.cat([text, all_text[draw.flatten()]]))
        positive, negative = pairs[: len(rows)], pairs[len(rows) :]
        loss = F.softplus(-positive.float()).sum() + F.softplus(negative.float()).sum()
        return {"loss": loss, "positive_logit": positive.detach().mean(), "negative_logit": negative.detach().mean()}

    def phrase_loss(self, model, out, batch) -> torch.Tensor:
        """Eq. 7 on each phrase with its positive region (z = +1) and with the negative regions
        drawn for it (z = -1; Algorithm 1: proposals of its image of IoU < 0.3 with its box, none
        a positive of a phrase of its chain). Each pair is its rank's: the shares sum exactly."""
        image, text = out["image"], out["text"]
        drawn = batch["drawn_negatives"].to(image.device)
        rows = torch.cat([batch["text_image"].to(image.device), drawn[1]])
        phrases = torch.cat([torch.arange(text.shape[0], device=image.device), drawn[0]])
        logits = model.pair_scores(image[rows], text[phrases]).float()
        labels = torch.ones_like(logits)
        labels[text.shape[0] :] = -1
        return F.softplus(-labels * logits).sum()

    def scores(self, model, images, texts):
        return model.all_pair_scores(images, texts)
