"""Contrastive Learning for image captioning (Dai & Lin, NIPS 2017): the `cl_caption` recipe.

A target captioner p_m(c | I; θ) learns against a frozen reference p_n(c | I; φ), both started from
the same MLE-trained captioner (§5.2). Each ground-truth pair (c_t, I_t) of the batch is a
positive; for each, K captions of *other* images of the whole global batch, paired with I_t, are
its negatives, drawn afresh every step. The loss is −J of Eq. 10 on the sentence log-probabilities
G = ln p_m − ln p_n (Eq. 7-9): `vldist.losses.contrastive_captioning`. Evaluation generates with
the target alone (`decoder` is the target's), so the captioner's metrics and self-retrieval
(Table 1) apply unchanged.

`python -m vldist.train cl_caption` runs two stages (`stages`): the MLE captioner (jobs/captioner.yaml
as it is) into <output.dir>/mle, then CL from its best checkpoint into <output.dir>/cl. With
model.captioner_run an existing captioner (or CL run, for Table 6's second round) is reused and
only CL runs. Paper: ../shared/papers/cl-contrastive-captioning.txt; notes: notes-cl.md.

Choices where the paper and the official code differ (notes-cl.md):
- negatives follow the paper, a caption drawn uniformly among all other images' captions for each
  positive and each of the K sets (`vldist.losses.negatives`); the official code gives an image's 5
  slots the 5 captions of one random other image;
- ln h is computed exactly (logsigmoid) rather than log(clip(h, 1e-20, 1));
- the target runs with dropout as in training (the official code), the reference in evaluation
  mode, so G != 0 at the start even though both hold the same weights.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vldist.config import JobConfig, updated
from vldist.data.samples import require_region_features
from vldist.distributed.collectives import global_sum
from vldist.distributed.zero import whole_parameters
from vldist.errors import ConfigError, IncompatibleCheckpoint
from vldist.losses import cross_rank_contrastive_captioning_loss
from vldist.losses.negatives import draw_negatives, gather_captions, step_generator
from vldist.losses.not_negative import local_identities
from vldist.models.generation import sequence_logprob
from vldist.recipes.base import StartingWeights
from vldist.recipes.captioner import CaptionerConfig, CaptionerModel, CaptionerRecipe

ARCHITECTURE_KEYS = ("decoder", "hidden", "embed")  # the captioner keys that shape the weights


class CLCaptionConfig(CaptionerConfig):
    init_from: str | None = Field(
        None,
        description="captioner checkpoint (or run dir) whose weights start target and reference; "
        "set by the MLE stage of `python -m vldist.train cl_caption`",
    )
    captioner_run: str | None = Field(
        None,
        description="reuse this captioner run dir or checkpoint instead of training the MLE stage "
        "(a cl_caption run works too: its target, Table 6's next round)",
    )
    captioner_job: str = Field("captioner", description="job file of the MLE stage")
    negatives: int = Field(5, ge=1, description="K negative sets per positive (Eq. 10; paper: 5)")
    nu: float = Field(1.0, gt=0, description="ν = T_n / T_m of Eq. 3 (paper: 1)")
    terms: Literal["full", "positive", "negative"] = Field(
        "full", description="full: CL; positive: CL(P); negative: CL(N) (Table 4)"
    )
    replace_reference_every: int = Field(
        0, ge=0, description="copy the target into the reference every N optimizer steps (Table 6; 0: never)"
    )


class CLCaptionModel(nn.Module):
    """A trained target and its frozen reference, two captioners of the same architecture.

    The reference never trains: its parameters need no gradient (so no optimizer holds them) and
    it stays in evaluation mode whatever `train()` says, so its dropout is off.
    """

    def __init__(self, cfg: CaptionerConfig, region_dim: int, vocab_size: int, pad_id: int = 0):
        super().__init__()
        self.pad_id = pad_id
        self.target = CaptionerModel(cfg, region_dim, vocab_size)
        self.reference = CaptionerModel(cfg, region_dim, vocab_size)
        self.reference.load_state_dict(self.target.state_dict())  # identical start (§5.2)
        self.reference.requires_grad_(False)
        self.reference.eval()

    @property
    def decoder(self) -> nn.Module:
        """The target's decoder: what evaluation, generation and self-retrieval use."""
        return self.target.decoder

    def train(self, mode: bool = True) -> CLCaptionModel:
        super().train(mode)
        self.reference.eval()
        return self

    @torch.no_grad()
    def replace_reference(self) -> None:
        """φ ← θ (§4.3, Table 6). Under ZeRO-3 the partitioned weights are gathered for the copy."""
        params = [*self.target.parameters(), *self.reference.parameters()]
        with whole_parameters(params):
            for ref, tgt in zip(self.reference.parameters(), self.target.parameters(), strict=True):
                ref.copy_(tgt)
            for ref, tgt in zip(self.reference.buffers(), self.target.buffers(), strict=True):
                ref.copy_(tgt)

    def forward(
        self,
        regions: torch.Tensor,
        mask: torch.Tensor,
        caption_images: torch.Tensor,
        tokens: torch.Tensor,
        negatives: torch.Tensor | None = None,
        replace_reference: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Sentence log-probabilities ln p(c | I) (end token included) under target and reference.

        tokens (T, L): the positives, caption t under image caption_images[t]; negatives (K, T, L'):
        the negative captions, [k, t] under caption t's image. Returns pos_target, pos_reference (T,)
        and, with negatives, neg_target, neg_reference (K, T). One decoder pass per model covers both.
        """
        if replace_reference:  # φ ← θ first (Table 6's periodic replacement)
            self.replace_reference()
        n = tokens.shape[0]
        rows, captions = caption_images, tokens
        if negatives is not None:
            width = max(tokens.shape[1], negatives.shape[2])
            captions = torch.cat(
                [
                    F.pad(tokens, (0, width - tokens.shape[1]), value=self.pad_id),
                    F.pad(negatives.flatten(0, 1), (0, width - negatives.shape[2]), value=self.pad_id),
                ]
            )
            rows = caption_images.repeat(negatives.shape[0] + 1)  # row k*T + t pairs with image of t
        features, masks, targets = regions[rows], mask[rows], captions[:, 1:]
        target = sequence_logprob(self.target(features, masks, captions), targets, self.pad_id)
        with torch.no_grad():
            reference = sequence_logprob(self.reference(features, masks, captions), targets, self.pad_id)
        out = {"pos_target": target[:n], "pos_reference": reference[:n]}
        if negatives is not None:
            out["neg_target"] = target[n:].view(negatives.shape[0], n)
            out["neg_reference"] = reference[n:].view(negatives.shape[0], n)
        return out


class CLCaptionRecipe(CaptionerRecipe):
    name = "cl_caption"
    description = (
        "Contrastive Learning for captioning (Dai & Lin 2017): target vs frozen reference, from an MLE captioner"
    )
    ModelConfig = CLCaptionConfig
    accumulate_negatives_refusal = (
        "a mismatched pair's log-probability is a forward of both captioners on that (image, caption) pair, not a "
        "product of per-row embeddings a cache could hold; and the loss is a mean over sampled pairs, with no "
        "max or softmax across the batch, so plain accumulation (negatives drawn within each micro-batch) already "
        "follows it"
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step = 0  # the optimizer step in progress (start_step)
        self._micro = 0  # forward_inputs() calls within it (gradient accumulation)
        self._replaced_at: int | None = None
        self.last_draw: dict | None = None  # the newest negatives, for inspection (tests)

    @property
    def cfg(self) -> CLCaptionConfig:
        return self.config.model

    # ------------------------------------------------------------------ stages

    @classmethod
    def stages(cls, config: JobConfig) -> list[tuple[str, JobConfig]]:
        """[("mle", the captioner job), ("cl", this job)], each with its own output dir under this
        job's; with model.captioner_run, only ("cl", ...) from that run's checkpoint."""
        out = config.output_dir
        cl_update = {"output": {"dir": str(out / "cl")}}
        if config.model.captioner_run:
            cl_update["model"] = {"init_from": config.model.captioner_run}
            return [("cl", updated(config, cl_update))]

        from vldist.recipes.jobs import load_config

        captioner = load_config(config.model.captioner_job, [])
        _check_same_captioner(config, captioner)
        mle = updated(
            captioner,
            {
                "seed": config.seed,
                "launcher": config.launcher,
                "data": {"shards": config.data.shards},
                "engine": config.engine.model_dump(),
                "metrics": config.metrics.model_dump(),
                "ray": config.ray.model_dump(),
                "output": {"dir": str(out / "mle")},
            },
        )
        cl_update["model"] = {"init_from": str(out / "mle" / "checkpoints" / "best")}
        cl_update["eval"] = {"baseline": False}  # the MLE stage's test result is CL's baseline
        return [("mle", mle), ("cl", updated(config, cl_update))]

    # ------------------------------------------------------------------ model

    def build_model(self) -> nn.Module:
        region_dim = require_region_features(self.feature_dim, self.config.data.shards, "the CL captioner")
        return CLCaptionModel(self.cfg, region_dim, len(self.vocab), self.vocab.pad_id)

    def starts_from(self) -> str:
        """The captioner of model.init_from: target and reference both start as it."""
        if not self.cfg.init_from:
            raise ConfigError(
                "model.init_from is not set: CL starts target and reference from a trained captioner. Run "
                "`python -m vldist.train cl_caption`, which trains the captioner first (the MLE stage), or set "
                "model.captioner_run=<captioner run dir or checkpoint> to reuse one"
            )
        return self.cfg.init_from

    def initialize(self, model: CLCaptionModel, start: StartingWeights | None, shards) -> None:
        state = self._initial_weights(model, start)
        model.target.load_state_dict(state)
        model.reference.load_state_dict(state)

    def _initial_weights(self, model: CLCaptionModel, start: StartingWeights) -> dict[str, torch.Tensor]:
        """The captioner weights of model.init_from (`decoder.*`), checked to fit this job."""
        checkpoint, raw, recipe = start.path, start.config, start.recipe
        if recipe == "captioner":
            prefix = ""
        elif recipe == self.name:  # a CL run's target (Table 6: the next round starts from it)
            prefix = "target."
        else:
            raise IncompatibleCheckpoint(
                f"model.init_from: {checkpoint} is a '{recipe}' checkpoint, not a captioner's (train one with "
                "`python -m vldist.train captioner`, or let `python -m vldist.train cl_caption` do it)"
            )
        saved_model = raw.get("model", {})
        reasons = [
            f"model.{k}: checkpoint {saved_model.get(k)!r}, this job {getattr(self.cfg, k)!r}"
            for k in ARCHITECTURE_KEYS
            if saved_model.get(k) != getattr(self.cfg, k)
        ]
        if start.vocab != self.vocab.itos:
            reasons.append(
                f"vocabulary: checkpoint {len(start.vocab)} words, this job {len(self.vocab)} or other words "
                "(data.shards and data.vocab_min_count must be the captioner's)"
            )
        state = {k[len(prefix) :]: v for k, v in start.state.items() if k.startswith(prefix + "decoder.")}
        expected = model.target.state_dict()
        if not reasons:
            missing = sorted(expected.keys() - state.keys())
            mismatched = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
            reasons += [f"{k}: missing from the checkpoint" for k in missing[:3]]
            reasons += [
                f"{k}: checkpoint {tuple(state[k].shape)}, this job {tuple(expected[k].shape)}" for k in mismatched[:3]
            ]
        if reasons:
            raise IncompatibleCheckpoint(
                f"model.init_from: {checkpoint} holds another captioner than this job builds:\n  "
                + "\n  ".join(reasons)
            )
        return {k: state[k] for k in expected}

    # ------------------------------------------------------------------ training

    def start_step(self, step: int) -> None:
        self._step, self._micro = step, 0

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        every = self.cfg.replace_reference_every
        replace = bool(every and self._step > 0 and self._step % every == 0 and self._replaced_at != self._step)
        if replace:  # in the step's first forward
            self._replaced_at = self._step
        negatives = self._draw_negatives(batch) if self.cfg.terms != "positive" else None
        self._micro += 1
        return {
            "regions": batch["regions"],
            "mask": batch["mask"],
            "caption_images": batch["caption_images"],
            "tokens": batch["tokens"],
            "negatives": negatives,
            "replace_reference": replace,
        }

    def losses(self, out: dict, batch: dict, update: str = "main", model=None) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        negatives = "neg_target" in out
        if not negatives:  # CL(P): no negative pairs
            empty = out["pos_target"].new_zeros((0, out["pos_target"].shape[0]))
            out["neg_target"], out["neg_reference"] = empty, empty
        loss = cross_rank_contrastive_captioning_loss(
            out["pos_target"], out["pos_reference"], out["neg_target"], out["neg_reference"], cfg.nu, cfg.terms
        )
        # Logged G: rank shares that sum to the global batch's mean (the loss's convention)
        g_pos = (out["pos_target"] - out["pos_reference"]).detach()
        n_global = global_sum(torch.tensor(float(g_pos.numel()), device=g_pos.device)).clamp(min=1)
        logged = {"loss": loss, "g_pos": g_pos.sum() / n_global}
        if negatives:
            g_neg = (out["neg_target"] - out["neg_reference"]).detach()
            logged["g_neg"] = g_neg.sum() / (n_global * g_neg.shape[0])
        return logged

    def _generator(self) -> torch.Generator:
        """Seeded from (seed, step, micro-batch): every rank draws alike; each draw differs."""
        return step_generator(self.config.seed, self._step, self._micro)

    def __getstate__(self):
        # loader workers receive the recipe pickled (pipeline.py): not the last step's tensors,
        # which may live on a GPU
        return {**self.__dict__, "last_draw": None}

    def _draw_negatives(self, batch: dict) -> torch.Tensor:
        """(K, T_local, L) negative captions of this rank's positives, drawn from every rank's
        captions: gathered, drawn alike on every rank (same global ids, same generator), this
        rank's columns taken."""
        tokens, rows = batch["tokens"], batch["caption_images"]
        # Each caption's image identity, global across ranks: a caption of another copy of the same
        # image (a batch drawn with replacement can hold one twice) is never its negative.
        identity = local_identities(batch.get("identity"), batch["regions"].shape[0], tokens.device)
        image_ids = identity[rows.to(tokens.device)]
        lengths = (tokens != self.vocab.pad_id).sum(dim=1)
        all_tokens, _, all_ids, offset = gather_captions(tokens, lengths, image_ids)
        draw = draw_negatives(all_ids, self.cfg.negatives, self._generator())[:, offset : offset + tokens.shape[0]]
        self.last_draw = {"draw": draw, "image_ids": all_ids, "offset": offset, "step": self._step}
        return all_tokens[draw]


# ---------------------------------------------------------------------- helpers


def _check_same_captioner(config: JobConfig, captioner: JobConfig) -> None:
    """The MLE stage trains the captioner job as it is: its architecture and vocabulary must be
    this job's, or its weights could not start CL. Checked before hours of MLE, not after."""
    if captioner.recipe != "captioner":
        raise ConfigError(
            f"model.captioner_job: '{config.model.captioner_job}' is a '{captioner.recipe}' job, not a captioner's"
        )
    pairs = [(f"model.{k}", getattr(captioner.model, k), getattr(config.model, k)) for k in ARCHITECTURE_KEYS]
    pairs.append(("data.vocab_min_count", captioner.data.vocab_min_count, config.data.vocab_min_count))
    differ = [f"{key}: captioner job {theirs!r}, this job {ours!r}" for key, theirs, ours in pairs if theirs != ours]
    if differ:
        raise ConfigError(
            f"the MLE stage (job '{config.model.captioner_job}') would train another captioner than CL builds; make "
            "them agree (or point model.captioner_job at a job that does):\n  " + "\n  ".join(differ)
        )
