"""L2C, Learning to Compare: describing the difference between two images.

Pixels in: a CNN trunk gives feature maps F, a mask head the foreground mask B (the model's own
prediction, trained on stored masks), semantic pooling K nodes v_k = Σ F ⊙ B ⊙ C_k (Eq. 1) with a
total-variation loss on the confidence maps C (Eq. 2), and a relation GCN over the nodes (Eq. 3,
VSRN's region GCN). A pair is described from the difference of its two images' nodes
V_diff = V_1 − V_2 (Eq. 4), a single image from its own nodes (Eq. 5), by one LSTM decoder with
attention over the nodes. Image pairs and single-image captions take turns, one optimizer step
each (the platform's training streams), L = L_diff + L_single + λ L_TV (Eq. 6). The CNN+LSTM
baseline of Table 1 (both images' pooled trunk features, concatenated, into an LSTM) is
`model.architecture=cnn_lstm`; the job runs it first and prints it beside L2C.
Paper: ../shared/papers/l2c-learning-to-compare.txt; open choices: docs/l2c.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vldist.config import JobConfig, Section, updated
from vldist.data.collate import pad_tokens
from vldist.data.pixels import read_image, read_mask, stack_masks
from vldist.data.samples import read_meta
from vldist.data.streams import StreamSource
from vldist.losses import cross_rank_mean, cross_rank_token_nll, total_variation_loss
from vldist.metrics.report import caption_report
from vldist.models.captioners import AdaptiveAttentionDecoder, ShowTellDecoder
from vldist.models.common import all_real
from vldist.models.l2c import L2CEncoder, build_trunk
from vldist.models.memory_format import channels_last_wanted, convert_to_channels_last
from vldist.recipes.base import Recipe, unwrap
from vldist.recipes.captioner import GeneratesCaptions
from vldist.recipes.l2c_pictures import pair_panel
from vldist.shards.synthetic.pairs import swap_image_tokens

PAIR_KEYS = ("json", "img1.jpg", "img2.jpg")
SINGLE_KEYS = ("json",)  # and a jpg or a png
MASKS_AND_PNG = ("img1.mask.png", "img2.mask.png", "mask.png", "png", "jpg")  # read when a sample has them


class L2CConfig(Section):
    architecture: Literal["l2c", "cnn_lstm"] = Field(
        "l2c",
        description="l2c: the paper's model; cnn_lstm: Table 1's baseline (pooled features of both images, concatenated)",
    )
    baseline_stage: bool = Field(
        True, description="the job trains the cnn_lstm baseline first and prints it beside L2C"
    )
    trunk: Literal["small", "resnet50", "resnet101", "fcn_resnet50", "fcn_resnet101"] = Field(
        "small",
        description="CNN trunk: small (CPU-sized, stride 8), a torchvision ResNet in the FCN layout, or torchvision's "
        "FCN whose segmentation of model.mask_class is the mask (paper: FCN ResNet-101)",
    )
    mask_class: int = Field(
        3, ge=0, lt=21, description="with an fcn_* trunk: the VOC class whose segmentation is the mask (3: bird)"
    )
    trunk_weights: str | None = Field(
        None, description="torchvision weights name or a local state-dict file (none: random init)"
    )
    image_size: int = Field(128, ge=32, description="images are resized to this square side")
    pooling: Literal["semantic", "average"] = Field(
        "semantic",
        description="semantic: K nodes by Eq. 1; average: masked average pooling, one node (Table 3's ablation)",
    )
    classes: int = Field(9, ge=1, description="K, semantic classes = graph nodes (paper: 9)")
    normalize_pool: bool = Field(
        False, description="divide each node by Σ B·C_k (the paper's Eq. 1 is an unnormalised sum)"
    )
    mask_threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="binarise the predicted mask at this probability (paper: 0.5 on an FCN's); none: pool with the probability",
    )
    graph_dim: int = Field(512, ge=1, description="graph node size (paper: 512)")
    gcn_layers: int = Field(2, ge=0, description="relation GCN layers (0: Table 3's '- GCN')")
    affinity_norm: Literal["count", "softmax"] = Field(
        "softmax", description="normalisation of the node affinity (Eq. 3)"
    )
    gcn_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="region-affinity kernel (vldist/kernels)"
    )
    gcn_products: Literal["auto", "folded", "direct"] = Field(
        "auto",
        description="GCN projections with their weights multiplied first where that is fewer multiply-adds "
        "(vldist/models/gcn.py, as VSRN's model.gcn_products)",
    )
    hidden: int = Field(512, ge=1, description="LSTM size (paper: 512)")
    embed: int = Field(512, ge=1, description="word embedding size")
    dropout: float = Field(0.5, ge=0, lt=1, description="dropout before the word classifier")
    tv_weight: float = Field(1.0, ge=0, description="λ of the TV loss (paper: 1; 0: Table 3's '- TV loss')")
    tv_reduction: Literal["mean", "sum"] = Field(
        "mean",
        description="TV per pixel, class and image (mean), or Eq. 2's plain sum over the global batch (sum: "
        "B·K·H·W, about 7e4, times stronger at the same λ)",
    )
    mask_weight: float = Field(1.0, ge=0, description="weight of the mask head's BCE on stored masks")
    single_images: bool = Field(
        True, description="train on single-image captions too, taking turns with pairs (paper: CUB+B2W)"
    )
    single_shards: str = Field("shards/synth", description="shard set of the single-image captions (paper: CUB)")
    single_split: str = Field("train", description="its split")
    single_batch_size: int = Field(
        64, ge=1, description="single images per step (paper: 128; pairs: data.batch_size, paper 16)"
    )
    captions_per_sample: int = Field(
        5, ge=1, description="descriptions of a pair (captions of an image) trained on per visit"
    )
    flip_pairs: bool = Field(True, description="swap a pair's images and its image1/image2 tokens with probability 1/2")
    visualize: int = Field(
        4, ge=0, description="pairs whose confidence maps and masks are saved as PNG at each evaluation"
    )


class L2CModel(nn.Module):
    def __init__(self, cfg: L2CConfig, vocab_size: int):
        super().__init__()
        self.architecture = cfg.architecture
        if cfg.architecture == "l2c":
            self.encoder = L2CEncoder(
                cfg.trunk,
                cfg.trunk_weights,
                cfg.pooling,
                cfg.classes,
                cfg.graph_dim,
                cfg.gcn_layers,
                cfg.affinity_norm,
                cfg.normalize_pool,
                cfg.mask_threshold,
                cfg.gcn_kernel,
                cfg.mask_class,
                cfg.gcn_products,
            )
            self.decoder = AdaptiveAttentionDecoder(vocab_size, cfg.graph_dim, cfg.hidden, cfg.embed, cfg.dropout)
        else:
            self.trunk, dim = build_trunk(cfg.trunk, cfg.trunk_weights)
            self.decoder = ShowTellDecoder(vocab_size, 2 * dim, cfg.hidden, cfg.embed, cfg.dropout)

    def use_channels_last(self) -> L2CModel:
        """The CNN part (trunk, mask and pooling convolutions) and its images in NHWC."""
        cnn = self.encoder if self.architecture == "l2c" else self.trunk
        convert_to_channels_last(cnn, [cnn])
        return self

    def features(self, images: torch.Tensor, second: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """What the decoder reads, (B, K, D), and the encoder's outputs for the auxiliary losses.
        A pair's two images go through the encoder as one batch (one set of BN statistics)."""
        both = images if second is None else torch.cat([images, second])
        if self.architecture == "cnn_lstm":
            pooled = self.trunk(both).mean(dim=(2, 3))
            first, other = (pooled, pooled) if second is None else pooled.chunk(2)
            return torch.cat([first, other], dim=-1)[:, None], {}
        out = self.encoder(both)
        if second is None:
            return out["nodes"], out
        first, other = out["nodes"].chunk(2)
        return first - other, out  # Eq. 4's V_diff: image 1 minus image 2

    def forward(self, images, second, tokens, rows) -> tuple[torch.Tensor, dict]:
        """Teacher-forced logits (N, T-1, V) of the caption rows (row n describes sample rows[n])."""
        features, aux = self.features(images, second)
        return self.decoder(features[rows], all_real(features[rows]), tokens), aux


class L2CRecipe(GeneratesCaptions, Recipe):
    name = "l2c"
    description = "L2C: describe the difference of two images (semantic pooling, relation GCN, single + pair streams)"
    ModelConfig = L2CConfig
    accumulate_negatives_refusal = (
        "its loss has no negatives: each caption's NLL is its own, so plain accumulation already keeps all there is"
    )
    sample_keys = PAIR_KEYS
    optional_keys = MASKS_AND_PNG
    dynamic_graph = True  # a stream without stored masks leaves the mask head without gradient

    @property
    def cfg(self) -> L2CConfig:
        return self.config.model

    @classmethod
    def stages(cls, config: JobConfig) -> list[tuple[str, JobConfig]]:
        """[("cnn_lstm", the baseline of Table 1), ("l2c", this job)] by default, printed side by side."""
        if config.model.architecture != "l2c" or not config.model.baseline_stage:
            return [(config.model.architecture, config)]
        baseline = updated(config, {"model": {"architecture": "cnn_lstm"}, "eval": {"baseline": False}})
        return [("cnn_lstm", baseline), ("l2c", config)]

    def build_model(self) -> nn.Module:
        model = L2CModel(self.cfg, len(self.vocab))
        # NHWC on CPU too: L2C's whole step measured faster so (models/memory_format.py)
        return model.use_channels_last() if channels_last_wanted(self.config, on_cpu=True) else model

    def checkpointed_blocks(self, model: L2CModel) -> list[nn.Module]:
        """The CNN trunk, each relation GCN layer and the decoder's whole teacher-forced unroll."""
        if model.architecture == "cnn_lstm":
            return [model.trunk, model.decoder]
        return [model.encoder.trunk, *model.encoder.gcn, model.decoder]

    @classmethod
    def train_streams(cls, config: JobConfig) -> dict[str, str | StreamSource]:
        cfg = config.model
        streams: dict[str, str | StreamSource] = {"pairs": config.data.train_split}
        if cfg.single_images and cfg.architecture == "l2c":  # the baseline reads pairs only
            streams["single"] = StreamSource(
                cfg.single_split,
                shards=cfg.single_shards,
                batch_size=cfg.single_batch_size,
                keys=SINGLE_KEYS,
                steps_like="pairs",
            )  # one of each per iteration, as the paper
        return streams

    def stream_functions(self, stream: str):
        if stream == "single":
            return self.single_sample, self.collate_train
        return self.train_sample, self.collate_train

    # ------------------------------------------------------------------ samples and batches

    def _pair(self, raw: dict) -> dict:
        size = self.cfg.image_size
        return {
            "images": read_image(raw, "img1.jpg", size),
            "second": read_image(raw, "img2.jpg", size),
            "masks": [read_mask(raw, "img1.mask.png", size), read_mask(raw, "img2.mask.png", size)],
        }

    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        captions = read_meta(raw)["captions"]
        sample = self._pair(raw)
        if self.cfg.flip_pairs and rng.random() < 0.5:  # image 2 becomes image 1: its tokens follow
            sample = {"images": sample["second"], "second": sample["images"], "masks": sample["masks"][::-1]}
            captions = [swap_image_tokens(c) for c in captions]
        return {**sample, "captions": self.encode_some(captions, self.cfg.captions_per_sample, rng)}

    def single_sample(self, raw: dict, rng: random.Random) -> dict:
        member = next((m for m in ("jpg", "png") if m in raw), "jpg")  # read_image names it when missing
        size = self.cfg.image_size
        return {
            "images": read_image(raw, member, size),
            "second": None,
            "masks": [read_mask(raw, "mask.png", size)],
            "captions": self.encode_some(read_meta(raw)["captions"], self.cfg.captions_per_sample, rng),
        }

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        return {
            **self._pair(raw),
            "key": raw["__key__"],
            "references": meta["captions"][: self.config.eval.max_captions_per_image],
        }

    def _collate_images(self, samples: list[dict]) -> dict:
        size = self.cfg.image_size
        # in the encoder's order: every sample's first image, then every second (features())
        ordered = [s["masks"][0] for s in samples] + [s["masks"][1] for s in samples if len(s["masks"]) > 1]
        masks, present = stack_masks(ordered, size)
        second = None if samples[0]["second"] is None else torch.stack([s["second"] for s in samples])
        return {
            "images": torch.stack([s["images"] for s in samples]),
            "second": second,
            "masks": masks,
            "mask_present": present,
        }

    def collate_train(self, samples: list[dict]) -> dict:
        length = self.config.data.max_caption_len if self.uniform_shapes else None
        tokens, _ = pad_tokens([c for s in samples for c in s["captions"]], length=length)
        counts = torch.tensor([len(s["captions"]) for s in samples])
        return {
            **self._collate_images(samples),
            "tokens": tokens,
            "caption_images": torch.repeat_interleave(torch.arange(len(samples)), counts),
        }

    def collate_eval(self, samples: list[dict]) -> dict:
        return {
            **self._collate_images(samples),
            "keys": [s["key"] for s in samples],
            "references": [s["references"] for s in samples],
        }

    # ------------------------------------------------------------------ losses

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        return {
            "images": batch["images"],
            "second": batch["second"],
            "tokens": batch["tokens"],
            "rows": batch["caption_images"],
        }

    def losses(self, outputs: tuple, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        logits, aux = outputs
        nll = cross_rank_token_nll(logits, batch["tokens"][:, 1:], self.vocab.pad_id)  # Eq. 4 or 5, per token
        name = "single" if batch["second"] is None else "diff"
        loss, parts = nll, {name: nll.detach()}
        if aux.get("confidence") is not None and self.cfg.tv_weight:
            confidence = aux["confidence"]
            if self.cfg.tv_reduction == "mean":
                tv = cross_rank_mean(total_variation_loss(confidence), confidence.shape[0])  # Eq. 2 per pixel
            else:  # the ranks' sums add up to the global batch's sum (losses/distributed.py's convention)
                tv = total_variation_loss(confidence, "sum")
            loss = loss + self.cfg.tv_weight * tv
            parts["tv"] = tv.detach()
        if aux and self.cfg.mask_weight:
            mask = cross_rank_mean(
                self._mask_loss(aux["mask_logits"], batch["masks"], batch["mask_present"]),
                int(batch["mask_present"].sum()),
            )
            loss = loss + self.cfg.mask_weight * mask
            parts["mask"] = mask.detach()
        return {"loss": loss, **parts}

    @staticmethod
    def _mask_loss(logits: torch.Tensor, masks: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """BCE of the mask head against the stored masks, averaged down to its resolution; zero
        (still a loss term, so every rank logs the same parts) where no image stores one."""
        if not bool(present.any()):
            return logits.sum() * 0.0
        target = F.adaptive_avg_pool2d(masks, logits.shape[-2:])
        return F.binary_cross_entropy_with_logits(logits[present].float(), target[present])

    # ------------------------------------------------------------------ generation and evaluation

    @torch.no_grad()
    def describe(self, model: nn.Module, images: torch.Tensor, second: torch.Tensor | None) -> tuple[list[str], dict]:
        """Generated descriptions of pairs (or captions of single images, `second` None), and the
        encoder's outputs (confidence maps and the predicted masks, never the stored ones)."""
        inner = unwrap(model)
        features, aux = inner.features(images, second)
        return self.generate_captions(inner.decoder, features), aux

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> dict:
        """One description per pair, scored against all its references (pycocoevalcap); the first
        `model.visualize` pairs' confidence maps and masks come back as images."""
        was_training = model.training
        model.eval()
        references, generated, panels = {}, {}, {}
        for batch in batches:
            images, second = batch["images"].to(device), batch["second"].to(device)
            descriptions, aux = self.describe(model, images, second)
            for key, refs, text in zip(batch["keys"], batch["references"], descriptions, strict=True):
                references[key], generated[key] = refs, text
            room = self.cfg.visualize - len(panels)
            if room > 0 and aux:
                n = len(batch["keys"])
                for i, key in enumerate(batch["keys"][:room]):
                    panels[f"{key}.png"] = pair_panel(
                        batch["images"][i],
                        batch["second"][i],
                        aux["mask"][i],
                        aux["mask"][n + i],
                        None if aux["confidence"] is None else aux["confidence"][i],
                        None if aux["confidence"] is None else aux["confidence"][n + i],
                    )
        model.train(was_training)
        if not generated:
            raise RuntimeError("the evaluation split yielded no samples")
        keys = list(generated)[: self.config.eval.examples]
        return {
            "captions": self.caption_metrics(references, generated),
            "n_images": len(generated),
            "n_captions": sum(len(r) for r in references.values()),
            "unit": "pairs",
            "examples": [{"key": k, "generated": generated[k], "references": references[k]} for k in keys],
            "images": panels,
        }

    @torch.no_grad()
    def caption_pixels(self, model: nn.Module, images: list, device: torch.device) -> list[str]:
        """`python -m vldist.caption RUN IMAGE1 IMAGE2 ...`: one description per pair of PIL images."""
        from vldist.data.pixels import image_tensor

        tensors = torch.stack([image_tensor(image, self.cfg.image_size) for image in images]).to(device)
        model.eval()
        return self.describe(model, tensors[0::2], tensors[1::2])[0]

    images_per_caption = 2  # vldist.caption groups the images given two by two

    def selection_score(self, metrics: dict) -> float:
        return metrics["captions"]["rouge_l"]  # the paper's main metric and its model selection

    @classmethod
    def headline(cls, metrics: dict) -> dict[str, float]:
        c = metrics["captions"]
        return {"bleu4": c["bleu4"], "rouge_l": c["rouge_l"], "cider_d": c["cider_d"]}

    @classmethod
    def report(cls, rows: dict[str, dict], split: str) -> str:
        return caption_report(rows, split)
