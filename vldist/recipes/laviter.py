"""LAViTeR: visual and textual representations aligned (VTA, DAMSM) and assisted by text-to-image
generation (TIM, an AttnGAN) and image captioning (ITM, a transformer), in three phases.

`python -m vldist.train laviter` runs the phases as stages (`stages`), each its own resumable run
starting from the previous one's best checkpoint (the embedded job first pretrains its small CNN
trunk on attribute labels, standing in for the paper's ImageNet-pretrained Inception):

1. vta:    DAMSM alone; E_I's trunk frozen except its projections.
2. assist: TIM and ITM trained on the frozen encoders; the discriminators and the rest take
           turns (`updates`).
3. joint:  everything, the first `model.frozen_blocks` blocks of E_I frozen (batch norm in eval),
           at a small learning rate: L = λ1 L_G + λ2 L_C + λ3 L_FI + λ4 L_FT + λ5 L_DAMSM (Eq. 16).

Evaluation: R-precision@1/3 (real images, and AttnGAN's on generated ones), AIMCoS (Eq. 17),
retrieval recall, the captioner's BLEU/METEOR/ROUGE-L/CIDEr-D and a PNG grid of generated images.
Paper: ../shared/papers/laviter.txt; its lost equations: ../shared/papers/notes-laviter.md;
choices: docs/laviter.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from vldist.config import JobConfig, Section, updated
from vldist.data.collate import pad_tokens
from vldist.data.pictures import to_pil
from vldist.data.pixels import read_image
from vldist.data.samples import read_meta
from vldist.errors import ConfigError
from vldist.losses import cross_rank_damsm_loss, cross_rank_mean, cross_rank_token_nll
from vldist.losses.not_negative import other_image_rows
from vldist.metrics import aimcos, r_precision, retrieval_recall
from vldist.models.alignment_encoders import TransformerSentenceEncoder
from vldist.models.common import l2norm, length_mask
from vldist.models.laviter import PHASES, LAViTeRModel
from vldist.models.memory_format import channels_last_wanted
from vldist.recipes.base import Recipe, StartingWeights, unwrap
from vldist.recipes.capabilities import joined_rows
from vldist.recipes.captioner import GeneratesCaptions
from vldist.recipes.laviter_report import laviter_report

LOSS_WEIGHTS = ("generator", "caption", "fake_image", "fake_text", "damsm")  # λ1..λ5 of Eq. 16


class LAViTeRConfig(Section):
    phase: Literal["all", "pretrain", "vta", "assist", "joint"] = Field(
        "all", description="all: the phases as stages of one job; or one phase alone (set model.init_from)"
    )
    pretrain_epochs: int = Field(
        0,
        ge=0,
        description="epochs of the small trunk's pretraining on the objects' attribute "
        "words before phase 1, the stand-in for ImageNet (0: none)",
    )
    pretrain_lr: float = Field(1e-3, gt=0, description="its learning rate")
    init_from: str | None = Field(None, description="start from this run dir or checkpoint (set by the stages)")
    vta_epochs: int = Field(2, ge=0, description="epochs of phase 1 (VTA alone)")
    assist_epochs: int = Field(2, ge=0, description="epochs of phase 2 (TIM and ITM on the frozen VTA)")
    joint_epochs: int = Field(1, ge=0, description="epochs of phase 3 (everything jointly)")
    vta_lr: float = Field(2e-4, gt=0, description="phase 1 learning rate (paper: 2e-4)")
    assist_lr: float = Field(2e-4, gt=0, description="phase 2: generator and discriminator lr (paper: 2e-4)")
    itm_lr: float = Field(1e-4, gt=0, description="phase 2: captioner lr (paper: 1e-4)")
    joint_lr: float = Field(1e-5, gt=0, description="phase 3 lr of every module (paper: 'small'; code: 1e-6)")
    vta_trunk: Literal["frozen", "trainable"] = Field("frozen", description="E_I's trunk in phase 1 (paper: frozen)")
    frozen_blocks: int = Field(
        5, ge=0, description="phase 3: E_I's first blocks kept frozen, batch norm in eval (paper: 5)"
    )
    image_encoder: Literal["small", "inception_v3"] = Field(
        "small", description="E_I: small (CPU-sized CNN, 64 regions) or inception_v3 (the paper's, 289 regions)"
    )
    image_weights: str | None = Field(
        None, description="inception_v3: torchvision weights name or local state-dict file"
    )
    image_size: int = Field(64, ge=32, description="E_I's input side (inception_v3: 299)")
    text_encoder: Literal["transformer", "bilstm"] = Field(
        "transformer", description="E_T: transformer (LAViTeR) or bilstm (AttnGAN's DAMSM, the baseline of Tables 2-3)"
    )
    embed_dim: int = Field(256, ge=8, description="D of words, regions, sentence and image vectors (paper: 256)")
    text_layers: int = Field(1, ge=1, description="transformer layers (paper: 1)")
    text_heads: int = Field(8, ge=1, description="transformer heads (paper: 8)")
    max_words: int = Field(15, ge=1, description="words per caption read by E_T (paper: 15)")
    gamma1: float = Field(4.0, gt=0, description="DAMSM γ1, attention over regions")
    gamma2: float = Field(5.0, gt=0, description="DAMSM γ2, word-to-caption aggregation")
    gamma3: float = Field(10.0, gt=0, description="DAMSM γ3, the softmax scale over the batch")
    tim: bool = Field(True, description="train the text-to-image GAN (Table 2's '+ text-to-image')")
    tim_stages: int = Field(1, ge=1, le=3, description="generator stages, 64/128/256 px (paper: 3)")
    tim_attend_first: bool = Field(True, description="word attention in the first stage too (AttnGAN: none there)")
    z_dim: int = Field(100, ge=1, description="noise size (AttnGAN: 100)")
    condition_dim: int = Field(100, ge=1, description="conditioning augmentation size (AttnGAN: 100)")
    gf_dim: int = Field(32, ge=1, description="generator width (COCO: 48, CUB: 32)")
    df_dim: int = Field(64, ge=1, description="discriminator width (COCO: 96, CUB: 64)")
    residual_blocks: int = Field(2, ge=0, description="residual blocks per attention stage (COCO: 3, CUB: 2)")
    itm: bool = Field(True, description="train the captioner (Table 2's '+ image-to-text')")
    itm_dim: int = Field(256, ge=8, description="captioner width (CATR: 256)")
    itm_heads: int = Field(8, ge=1, description="captioner heads (paper: 8)")
    itm_encoder_layers: int = Field(6, ge=1, description="captioner encoder layers (paper: 6)")
    itm_decoder_layers: int = Field(6, ge=1, description="captioner decoder layers (paper: 6)")
    itm_feedforward: int = Field(1024, ge=8, description="captioner feed-forward size")
    itm_dropout: float = Field(0.1, ge=0, lt=1, description="captioner dropout")
    generated_text: Literal["teacher_forced", "free_running"] = Field(
        "teacher_forced",
        description="L_FT's generated text: the argmax of the teacher-forced captioner (the authors' "
        "code; free) or greedy decoding from the image (the paper's reading; T passes)",
    )
    weight_generator: float = Field(1.0, ge=0, description="λ1: L_G, adversarial + conditioning-augmentation KL")
    weight_caption: float = Field(1.0, ge=0, description="λ2: L_C, the captioner's token NLL")
    weight_fake_image: float = Field(1.0, ge=0, description="λ3: L_FI, DAMSM of generated images and real text")
    weight_fake_text: float = Field(1.0, ge=0, description="λ4: L_FT, DAMSM of real images and generated text")
    weight_damsm: float = Field(
        50.0, ge=0, description="λ5: L_DAMSM of real images and real text (the authors' code: 50)"
    )
    r_precision_candidates: int = Field(
        100, ge=2, description="R-precision pool: the own caption and N-1 others (AttnGAN: 100)"
    )
    caption_metrics: bool = Field(
        True,
        description="score the captioner with pycocoevalcap at each test evaluation "
        "(the ablation bench turns it off: Table 2 needs none)",
    )
    grid: int = Field(
        8, ge=0, description="generated images saved as a PNG grid at each evaluation, for the first captions"
    )

    @model_validator(mode="after")
    def _real_images_as_large_as_generated(self) -> LAViTeRConfig:
        largest = 64 * 2 ** (self.tim_stages - 1)
        if self.tim and self.image_size < largest:  # upsampled real images would tell the discriminator apart
            raise ValueError(
                f"model.tim_stages={self.tim_stages} generates {largest}-pixel images, but real images "
                f"are read at model.image_size={self.image_size}: set image_size >= {largest}"
            )
        return self


class LAViTeRRecipe(GeneratesCaptions, Recipe):
    name = "laviter"
    description = "LAViTeR: DAMSM alignment assisted by text-to-image generation and captioning, three phases"
    ModelConfig = LAViTeRConfig
    sample_keys = ("json", "jpg")
    dynamic_graph = True  # phases and alternating updates leave modules without gradient
    # E_T's words padded to model.max_words change the DAMSM and generator losses (measured: the
    # first VTA step's loss 346.35 -> 354.24), so compiled runs keep each batch's own length
    compile_pads_captions = False

    @property
    def cfg(self) -> LAViTeRConfig:
        return self.config.model

    @property
    def phase(self) -> str:
        return "vta" if self.cfg.phase == "all" else self.cfg.phase

    def preflight(self, shards) -> None:
        if self.cfg.itm and self.cfg.caption_metrics:
            super().preflight(shards)  # Java, for pycocoevalcap

    # ------------------------------------------------------------------ phases

    @classmethod
    def stages(cls, config: JobConfig) -> list[tuple[str, JobConfig]]:
        """One stage per phase with epochs (assist only with TIM or ITM; pretrain only for a trunk
        without weights), each from the one before."""
        cfg = config.model
        pretrained = cfg.image_weights is not None  # a real trunk brings its own pretraining
        epochs = {
            "pretrain": 0 if pretrained else cfg.pretrain_epochs,
            "vta": cfg.vta_epochs,
            "assist": cfg.assist_epochs if cfg.tim or cfg.itm else 0,
            "joint": cfg.joint_epochs,
        }
        lrs = {"pretrain": cfg.pretrain_lr, "vta": cfg.vta_lr, "assist": cfg.assist_lr, "joint": cfg.joint_lr}
        if cfg.phase != "all":  # one phase alone, with that phase's epochs and lr
            return [
                (cfg.phase, updated(config, {"train": {"epochs": max(epochs[cfg.phase], 1), "lr": lrs[cfg.phase]}}))
            ]
        stages, previous = [], cfg.init_from
        for phase in PHASES:
            if not epochs[phase]:
                continue
            stage = updated(
                config,
                {
                    "model": {"phase": phase, "init_from": previous},
                    "train": {"epochs": epochs[phase], "lr": lrs[phase]},
                    "eval": {"baseline": config.eval.baseline and not stages},
                },
            )
            stages.append((phase, stage))
            previous = str(config.output_dir / phase)  # its best checkpoint, else its last (find_checkpoint)
        if not stages:
            raise ValueError("model.vta_epochs, assist_epochs and joint_epochs are all 0: nothing to train")
        if config.train.accumulate_negatives:  # refused before the first phase trains, not when its turn comes
            for phase, _ in stages:
                if reason := _negatives_refusal(phase):
                    raise ConfigError(f"train.accumulate_negatives=true with model.phase=all: {reason}")
        return stages

    def build_model(self) -> nn.Module:
        model = LAViTeRModel(
            self.cfg, len(self.vocab), self.config.data.max_caption_len, self.vocab.end_id, self.vocab.start_id
        )
        model.set_phase(self.phase, self.cfg.vta_trunk, self.cfg.frozen_blocks)
        return model.use_channels_last() if channels_last_wanted(self.config) else model

    checkpoint_compiles = False
    checkpoint_compile_refusal = (
        "torch 2.14's dynamo fails on a checkpointed nn.TransformerEncoderLayer inside nn.TransformerEncoder "
        "(AssertionError: lift_tracked_freevar_to_input should not be called on root SubgraphTracer)"
    )

    def checkpointed_blocks(self, model: LAViTeRModel) -> list[nn.Module]:
        """Every transformer layer (E_T's, the captioner's encoder and decoder), the generator's
        stages and the discriminators; frozen ones stay in eval mode and run plainly."""
        blocks: list[nn.Module] = []
        if isinstance(model.text_encoder, TransformerSentenceEncoder):
            blocks += model.text_encoder.layers.layers
        if model.captioner is not None:
            blocks += [*model.captioner.encoder.layers, *model.captioner.decoder.layers]
        if model.generator is not None:
            g = model.generator
            blocks += [g.init_stage, *([g.first_refine] if g.first_refine is not None else []), *g.next_stages]
            blocks += model.discriminators
        return blocks

    def starts_from(self) -> str | None:
        """The previous phase's run (the stage sets model.init_from), if any."""
        return self.cfg.init_from

    def initialize(self, model: LAViTeRModel, start: StartingWeights | None, shards) -> None:
        """Each phase starts from the previous phase's model; the pretraining's label head stays
        behind."""
        if start is not None:
            missing, unexpected = model.load_state_dict(start.state, strict=False)
            wrong = [k for k in [*missing, *unexpected] if not k.startswith("label_head.")]
            if wrong:
                raise ValueError(
                    f"model.init_from={self.cfg.init_from} does not fit this model ({len(wrong)} "
                    f"entries differ, e.g. {wrong[0]}): use a LAViTeR run of the same model keys"
                )

    def optimizer_groups(self, model: LAViTeRModel) -> dict[str, list]:
        critic = {id(p) for p in model.discriminators.parameters()} if model.trains(model.discriminators) else set()
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in critic]
        if self.phase == "assist" and model.trains(model.captioner):  # ITM has its own lr in phase 2
            captioner = {id(p) for p in model.captioner.parameters()}
            others = [p for p in rest if id(p) not in captioner]
            rest = [
                *([{"params": others}] if others else []),
                {"params": list(model.captioner.parameters()), "lr": self.cfg.itm_lr},
            ]
        if not critic:
            return {"main": rest}
        return {"discriminator": list(model.discriminators.parameters()), "main": rest}

    def updates(self, step: int) -> tuple[str, ...]:
        gan = self.cfg.tim and self.phase in ("assist", "joint")
        return ("discriminator", "main") if gan else ("main",)  # AttnGAN: D first, then G

    def weights(self) -> dict[str, float]:
        """λ per loss term in this phase: phase 1 trains DAMSM alone, phase 2 the assisting tasks."""
        cfg = self.cfg
        weights = {name: getattr(cfg, f"weight_{name}") for name in LOSS_WEIGHTS}
        if self.phase == "pretrain":
            return {"labels": 1.0}
        if self.phase == "vta":
            return {"damsm": weights["damsm"]}
        if self.phase == "assist":  # E_T and E_I frozen: L_FT and L_DAMSM would move nothing
            weights.update(fake_text=0.0, damsm=0.0)
        if not cfg.tim:
            weights.update(generator=0.0, fake_image=0.0)
        if not cfg.itm:
            weights.update(caption=0.0, fake_text=0.0)
        return weights

    # ------------------------------------------------------------------ samples and batches

    def words(self, caption: str) -> list[int]:
        """E_T's input: the caption's word ids without <start>/<end>, at most model.max_words."""
        return self.vocab.encode(caption)[1:-1][: self.cfg.max_words] or [self.vocab.unk_id]

    def labels(self, meta: dict) -> list[int]:
        """The trunk pretraining's targets: ids of the objects' attribute words (colour, shape, size)."""
        return sorted(
            {
                self.vocab.stoi[w]
                for o in meta.get("objects", [])
                for w in (o.get("color"), o.get("shape"), o.get("size"))
                if w in self.vocab.stoi
            }
        )

    def train_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        caption = rng.choice(meta["captions"])  # AttnGAN: one random caption per visit
        sample = {
            "image": read_image(raw, "jpg", self.cfg.image_size, "tanh"),
            "words": self.words(caption),
            "tokens": self.vocab.encode(caption, self.config.data.max_caption_len),
        }
        if self.phase == "pretrain":
            sample["labels"] = self.labels(meta)
            if not sample["labels"]:
                raise ValueError(f"sample {raw['__key__']} has no objects with attribute words to pretrain on")
        return sample

    def eval_sample(self, raw: dict, rng: random.Random) -> dict:
        meta = read_meta(raw)
        captions = meta["captions"][: self.config.eval.max_captions_per_image]
        return {
            "key": raw["__key__"],
            "image": read_image(raw, "jpg", self.cfg.image_size, "tanh"),
            "references": captions,
            "caption_words": [self.words(c) for c in captions],
            "attribute_words": [self.words(a) for a in attribute_texts(meta)],
            "labels": self.labels(meta),
        }

    def collate_train(self, samples: list[dict]) -> dict:
        uniform = self.uniform_shapes
        words, lengths = pad_tokens([s["words"] for s in samples], length=self.cfg.max_words if uniform else None)
        tokens, _ = pad_tokens(
            [s["tokens"] for s in samples], length=self.config.data.max_caption_len if uniform else None
        )
        batch = {
            "images": torch.stack([s["image"] for s in samples]),
            "words": words,
            "lengths": lengths,
            "tokens": tokens,
        }
        if "labels" in samples[0]:
            batch["labels"] = multi_hot([s["labels"] for s in samples], len(self.vocab))
        return batch

    def collate_eval(self, samples: list[dict]) -> dict:
        def flat(key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            rows = [w for s in samples for w in s[key]]
            owners = torch.tensor([i for i, s in enumerate(samples) for _ in s[key]], dtype=torch.long)
            words, lengths = pad_tokens(rows) if rows else (torch.zeros(0, 1, dtype=torch.long), torch.zeros(0))
            return words, lengths, owners

        captions, attributes = flat("caption_words"), flat("attribute_words")
        return {
            "keys": [s["key"] for s in samples],
            "images": torch.stack([s["image"] for s in samples]),
            "references": [s["references"] for s in samples],
            "captions": captions,
            "attributes": attributes,
            "labels": [s["labels"] for s in samples],
        }

    # ------------------------------------------------------------------ losses

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        images, batch_size = batch["images"], batch["images"].shape[0]
        if batch_size < 2 and self.cfg.tim and self.phase in ("assist", "joint"):
            raise ValueError(
                "LAViTeR's GAN needs at least 2 images per rank in a step (batch norm, mismatched "
                "captions): raise data.batch_size to 2 x the number of ranks or more"
            )
        noise = torch.randn(batch_size, self.cfg.z_dim, device=images.device)
        identity = batch.get("identity")  # pairs of one image are never negatives (data/identity.py)
        mismatched = None
        if update == "discriminator" and identity is not None:
            mismatched = other_image_rows(identity.to(images.device))
        return {
            "images": images,
            "words": batch["words"],
            "lengths": batch["lengths"],
            "tokens": batch["tokens"],
            "update": update,
            "noise": noise,
            "weights": self.weights(),
            "mismatched": mismatched,
        }

    def losses(self, out: dict, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        batch_size, weights = batch["images"].shape[0], self.weights()
        identity = batch.get("identity")
        if update == "discriminator":
            loss = cross_rank_mean(out["discriminator"], batch_size)
            return {"loss": loss, "discriminator": loss.detach()}
        if "label_logits" in out:
            return self.micro_batch_losses(out, batch)
        terms: dict[str, torch.Tensor] = {}
        gammas = (self.cfg.gamma1, self.cfg.gamma2, self.cfg.gamma3)
        if weights.get("damsm"):
            terms["damsm"] = cross_rank_damsm_loss(
                out["words"], out["lengths"], out["regions"], out["sentence"], out["image"], *gammas, identity=identity
            )
        if "caption_logits" in out:
            terms["caption"] = cross_rank_token_nll(out["caption_logits"], batch["tokens"][:, 1:], self.vocab.pad_id)
        if "adversarial" in out:
            terms["generator"] = cross_rank_mean(out["adversarial"] + out["kl"], batch_size)
            if weights.get("fake_image"):
                terms["fake_image"] = cross_rank_damsm_loss(
                    out["words"],
                    out["lengths"],
                    out["fake_regions"],
                    out["sentence"],
                    out["fake_image"],
                    *gammas,
                    identity=identity,
                )
        if "generated_words" in out:
            terms["fake_text"] = cross_rank_damsm_loss(
                out["generated_words"],
                out["generated_lengths"],
                out["regions"],
                out["generated_sentence"],
                out["image"],
                *gammas,
                identity=identity,
            )
        loss = sum(weights[name] * value for name, value in terms.items())
        return {"loss": loss, **{name: value.detach() for name, value in terms.items()}}

    # ------------------------------------------------------------------ train.accumulate_negatives

    # recipes/capabilities.py's CachesNegatives, phases pretrain (the labels' loss, a per-image
    # mean: per micro-batch, exact) and vta (DAMSM over the global batch from cached word, region,
    # sentence and image features, exact). Not phases assist and joint: see negatives_refusal.

    def negatives_refusal(self) -> str:
        return _negatives_refusal(self.phase)

    def cross_batch_embeddings(self, out: dict) -> dict[str, torch.Tensor]:
        if "label_logits" in out:
            return {}
        # each micro-batch pads its words to its own longest caption; DAMSM masks by length, so
        # padding to max_words lets the micro-batches be concatenated without changing the loss
        words = F.pad(out["words"], (0, 0, 0, self.cfg.max_words - out["words"].shape[1]))
        return {"words": words, "regions": out["regions"], "sentence": out["sentence"], "image": out["image"]}

    def joined_batch(self, batches: list[dict]) -> dict:
        return joined_rows(batches, "lengths", "identity")

    def cross_batch_losses(self, embeddings: dict, batch: dict) -> dict[str, torch.Tensor]:
        e = embeddings
        gammas = (self.cfg.gamma1, self.cfg.gamma2, self.cfg.gamma3)
        damsm = cross_rank_damsm_loss(
            e["words"],
            batch["lengths"],
            e["regions"],
            e["sentence"],
            e["image"],
            *gammas,
            identity=batch.get("identity"),
        )
        return {"loss": self.weights()["damsm"] * damsm, "damsm": damsm.detach()}

    def micro_batch_losses(self, out: dict, batch: dict) -> dict[str, torch.Tensor]:
        if "label_logits" not in out:
            return {}
        bce = F.binary_cross_entropy_with_logits(out["label_logits"].float(), batch["labels"])
        loss = cross_rank_mean(bce, batch["images"].shape[0])
        return {"loss": loss, "labels": loss.detach()}

    def micro_batch_weight(self, batch: dict) -> int:
        return batch["images"].shape[0]

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[dict], device: torch.device, validation: bool = False
    ) -> dict:
        inner: LAViTeRModel = unwrap(model)
        was_training = model.training
        model.eval()
        captioning = (
            inner.captioner is not None
            and self.cfg.caption_metrics
            and (not validation or (self.phase == "assist" and inner.generator is None))
        )  # see selection_score
        vectors = {"image": [], "own": [], "captions": [], "attributes": [], "fake": []}
        owners = {"captions": [], "attributes": []}
        references, generated, grid_images, grid_captions, seen = {}, {}, [], [], 0
        label_hits = label_count = 0
        noise = torch.Generator().manual_seed(self.config.seed)
        for batch in batches:
            images = batch["images"].to(device)
            local, pooled = inner.image_encoder.trunk(images)
            regions, image = inner.image_encoder.project(local, pooled)
            vectors["image"].append(image.float().cpu())
            if inner.label_head is not None:  # trunk pretraining: its top-n words against the n true ones
                scores = inner.label_head(pooled).float().cpu()
                for row, labels in zip(scores, batch["labels"], strict=True):
                    label_hits += len(set(row.topk(len(labels)).indices.tolist()) & set(labels))
                    label_count += len(labels)
            encoded = {}
            for key in ("captions", "attributes"):
                words, lengths, owner = batch[key]
                if len(owner):
                    encoded[key] = inner.text_encoder(words.to(device), lengths.to(device))
                    vectors[key].append(encoded[key][1].float().cpu())
                    owners[key].append(owner + seen)
            # Each image's own (first) caption, for R-precision and the generator: rows of the encoding above.
            owner = batch["captions"][2]
            first = torch.tensor([int((owner == i).nonzero()[0]) for i in range(len(images))], device=device)
            text_words, sentence = (x.index_select(0, first) for x in encoded["captions"])
            own_lengths = batch["captions"][1].to(device).index_select(0, first)
            vectors["own"].append(sentence.float().cpu())
            if inner.generator is not None:
                z = torch.randn(len(images), self.cfg.z_dim, generator=noise).to(device)
                epsilon = torch.randn(len(images), self.cfg.condition_dim, generator=noise).to(device)
                fakes = inner.generator(
                    z, sentence, text_words, length_mask(own_lengths, text_words.shape[1]), condition_noise=epsilon
                )  # the same images for the same weights
                fake = fakes["images"][-1]
                vectors["fake"].append(inner.image_encoder(fake)[1].float().cpu())
                room = self.cfg.grid - len(grid_images)
                grid_images += list(fake[:room].float().cpu())
                grid_captions += [refs[0] for refs in batch["references"][:room]]
            if captioning:
                texts = self.generate_captions(inner.captioner, regions)
                for key, refs, text in zip(batch["keys"], batch["references"], texts, strict=True):
                    references[key], generated[key] = refs, text
            seen += len(images)
        model.train(was_training)
        if not seen:
            raise RuntimeError("the evaluation split yielded no samples")
        metrics = self._metrics(vectors, owners, references, generated, grid_images, grid_captions, seen)
        if label_count:
            metrics["label_recall"] = 100.0 * label_hits / label_count
        return metrics

    @torch.no_grad()
    def caption_pixels(self, model: nn.Module, images: list, device: torch.device) -> list[str]:
        """`python -m vldist.caption RUN IMAGE ...`: the captioner (ITM) on E_I's regions of PIL images."""
        from vldist.data.pixels import image_tensor

        inner: LAViTeRModel = unwrap(model)
        if inner.captioner is None:
            raise ValueError("this LAViTeR model has no captioner (model.itm=false): it cannot caption images")
        model.eval()
        pixels = torch.stack([image_tensor(image, self.cfg.image_size, "tanh") for image in images]).to(device)
        regions, _ = inner.image_encoder(pixels)
        return self.generate_captions(inner.captioner, regions)

    def _metrics(self, vectors, owners, references, generated, grid_images, grid_captions, seen) -> dict:
        image, own = torch.cat(vectors["image"]), torch.cat(vectors["own"])
        candidates = min(self.cfg.r_precision_candidates, seen)
        metrics: dict = {
            "n_images": seen,
            "candidates": candidates,
            "r_precision": {
                f"r{k}": r_precision(image, own, candidates, self.config.seed, k) for k in (1, 3) if k <= candidates
            },
        }
        if vectors["fake"]:  # AttnGAN's R-precision: generated images against their own captions
            fake = torch.cat(vectors["fake"])
            metrics["generated_r_precision"] = {
                f"r{k}": r_precision(fake, own, candidates, self.config.seed, k) for k in (1, 3) if k <= candidates
            }
        captions, caption_owner = torch.cat(vectors["captions"]), torch.cat(owners["captions"])
        metrics["retrieval"] = retrieval_recall(
            l2norm(image) @ l2norm(captions).T, caption_images=caption_owner.numpy()
        )
        metrics["n_captions"] = len(caption_owner)
        if vectors["attributes"]:
            metrics["aimcos"] = aimcos(image, torch.cat(vectors["attributes"]), torch.cat(owners["attributes"]))
        if generated:
            keys = list(generated)[: self.config.eval.examples]
            metrics["captions"] = self.caption_metrics(references, generated)
            metrics["examples"] = [{"key": k, "generated": generated[k], "references": references[k]} for k in keys]
        if grid_images:
            import torchvision  # here, not at the top: it loads torch._dynamo and sympy (~0.9 s), which --help need not pay

            grid = torchvision.utils.make_grid(
                torch.stack(grid_images), nrow=min(len(grid_images), 4), padding=2, normalize=True, value_range=(-1, 1)
            )
            metrics["images"] = {"generated-grid.png": to_pil(grid, value_range="unit")}
            metrics["grid_captions"] = grid_captions
        return metrics

    def selection_score(self, metrics: dict) -> float:
        """Phases 1 and 3: R-precision@1 of real images. Phase 2 trains only TIM and ITM: AttnGAN's
        R-precision@1 of generated images (no Java needed, so validation stays cheap), or CIDEr-D
        when there is no generator."""
        if self.phase == "pretrain":
            return metrics["label_recall"]
        if self.phase == "assist":
            if "generated_r_precision" in metrics:
                return metrics["generated_r_precision"]["r1"]
            return metrics.get("captions", {}).get("cider_d", 0.0)
        return metrics["r_precision"]["r1"]

    @classmethod
    def headline(cls, metrics: dict) -> dict[str, float]:
        line = {"r_precision1": metrics["r_precision"]["r1"], "rsum": metrics["retrieval"]["rsum"]}
        if "label_recall" in metrics:
            line["label_recall"] = metrics["label_recall"]
        if "generated_r_precision" in metrics:
            line["generated_r_precision1"] = metrics["generated_r_precision"]["r1"]
        if "aimcos" in metrics:
            line["aimcos"] = metrics["aimcos"]
        if "captions" in metrics:
            line["cider_d"] = metrics["captions"]["cider_d"]
        return line

    @classmethod
    def report(cls, rows: dict[str, dict], split: str) -> str:
        return laviter_report(rows, split)


def multi_hot(rows: list[list[int]], size: int) -> torch.Tensor:
    targets = torch.zeros(len(rows), size)
    for i, ids in enumerate(rows):
        targets[i, ids] = 1.0
    return targets


def attribute_texts(meta: dict) -> list[str]:
    """AIMCoS's attribute texts of an image (Eq. 17): a sample's `attributes` list (CUB's attribute
    annotations) or, on the embedded scenes, each object's phrase and its attribute words."""
    if meta.get("attributes"):
        return list(meta["attributes"])
    texts: list[str] = []
    for obj in meta.get("objects", []):
        for text in (obj.get("phrase"), obj.get("size"), obj.get("color"), obj.get("shape")):
            if text and text not in texts:
                texts.append(text)
    return texts


def _negatives_refusal(phase: str) -> str:
    """Why train.accumulate_negatives cannot run phase `phase` ('' when it can)."""
    if phase in ("assist", "joint"):
        return (
            f"phase {phase} alternates GAN updates and scores generated images and captions (L_FI, L_FT), "
            "which the cache does not hold: it is built for phases pretrain and vta (model.phase=vta, or "
            "model.assist_epochs=0 and model.joint_epochs=0)"
        )
    return ""
