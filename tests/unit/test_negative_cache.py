"""train.accumulate_negatives in one process (training/negative_cache.py): the step's loss and
gradients against the whole batch's written out here, the random state of the cached and re-run
forwards (dropout), what BatchNorm's statistics cover, and the refusals.

The multi-rank proof (W ranks, Accelerate and ZeRO-2): tests/integration/test_accumulate_negatives.py.
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "workers"))
import accumulate_negatives_step as worker  # noqa: E402
import equivalence_step as base  # noqa: E402
from engines import cpu_engine  # noqa: E402

from vldist.data.vocab import Vocab  # noqa: E402
from vldist.errors import ConfigError, RandomStateMismatch  # noqa: E402
from vldist.recipes.jobs import load_config  # noqa: E402
from vldist.recipes.two_branch import TwoBranchEmbedRecipe, TwoBranchSimRecipe  # noqa: E402
from vldist.training import negative_cache  # noqa: E402
from vldist.training.negative_cache import NegativeCache, check_supported  # noqa: E402

MARGIN = 0.2


def _whole_batch_vsrn_loss(out: dict, tokens: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """VSE++ (hardest negative in each direction, summed over the batch) and the caption NLL
    (per caption: summed over its tokens, averaged over captions; per token: over all real
    tokens) of the whole batch, written from the paper."""
    scores = out["image"] @ out["text"].T
    positive = scores.diag()
    eye = torch.eye(len(scores), dtype=torch.bool)
    caption_cost = (MARGIN + scores - positive[:, None]).clamp(min=0).masked_fill(eye, 0)  # image anchors
    image_cost = (MARGIN + scores - positive[None, :]).clamp(min=0).masked_fill(eye, 0)  # caption anchors
    matching = caption_cost.max(1).values.sum() + image_cost.max(0).values.sum()
    targets = tokens[:, 1:]
    nll = F.cross_entropy(out["caption_logits"].flatten(0, 1), targets.flatten(), ignore_index=0, reduction="sum")
    caption = nll / (targets.shape[0] if reduction == "caption" else (targets != 0).sum())
    return matching, caption


def _global_values(losses: dict, update: str) -> dict[str, float]:
    return {k: float(v.detach()) for k, v in losses.items()}


@pytest.mark.parametrize(("micro_batches", "reduction"), [(2, "caption"), (4, "token")])
def test_the_step_is_the_whole_batch_loss_and_gradient(micro_batches, reduction):
    """Micro-batches of unequal token counts: per token, each micro-batch's caption term counts by
    its share of the batch's tokens, not by 1/N."""
    overrides = [f"model.caption_loss_reduction={reduction}"]
    recipe = worker.make_recipe("accelerate", micro_batches, *overrides)
    model = base.build_model(recipe)
    batch = recipe.collate_train(base.global_samples())
    matching, caption = _whole_batch_vsrn_loss(model(**recipe.forward_inputs(batch)), batch["tokens"], reduction)
    (matching + caption).backward()
    matching, caption = float(matching.detach()), float(caption.detach())
    expected = {n: p.grad for n, p in model.named_parameters()}

    run = worker.cached_step(cpu_engine(), recipe, micro_batches)
    assert run["matching"] == pytest.approx(matching, rel=1e-5)
    assert run["caption"] == pytest.approx(caption, rel=1e-5)
    assert run["loss"] == pytest.approx(matching + caption, rel=1e-5)
    assert expected.keys() == run["grads"].keys()
    for name, grad in expected.items():
        assert torch.allclose(run["grads"][name], grad, rtol=1e-4, atol=1e-5), name


# ---------------------------------------------------------------- two-branch: dropout, BatchNorm

VOCAB = Vocab(["a", "red", "circle", "blue", "square", "green", "star"])
DIM = 6


def _two_branch(*overrides: str) -> TwoBranchEmbedRecipe:
    tiny = ["model.hidden=12", "model.embed=8", "model.top_k=3", "model.margin=0.5", "model.tasks=[retrieval]"]
    return TwoBranchEmbedRecipe(load_config("two_branch_embed", [*tiny, *overrides]), VOCAB, DIM)


def _two_branch_batches(recipe, micro_batches: int, images: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    samples = [
        {
            "image": rng.standard_normal(DIM).astype(np.float32),
            "captions": [VOCAB.encode(" ".join(rng.choice(words, size=1 + (i + j) % 4))) for j in range(1 + i % 3)],
        }
        for i in range(images)
    ]
    m = images // micro_batches
    return [recipe.collate_train(samples[k * m : (k + 1) * m]) for k in range(micro_batches)]


def _cached_step(recipe, batches, seed: int = 0):
    """The model after one NegativeCache accumulation (no optimizer step) and its losses."""
    torch.manual_seed(0)
    model = recipe.build_model()
    engine = cpu_engine()
    wrapped = engine.setup(model, {"main": torch.optim.SGD(model.parameters(), lr=0.1)})
    torch.manual_seed(seed)
    logged = NegativeCache(recipe, engine).accumulate(wrapped, batches, "main", _global_values)
    return model, logged


def _direct(recipe, batches, seed: int = 0):
    """The cross-batch loss of the micro-batches' embeddings, each micro-batch run once with
    gradient in turn (its own dropout draws and BatchNorm statistics), concatenated."""
    torch.manual_seed(0)
    model = recipe.build_model()
    torch.manual_seed(seed)
    outs = [recipe.cross_batch_embeddings(model(**recipe.forward_inputs(b))) for b in batches]
    embeddings = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    loss = recipe.cross_batch_losses(embeddings, recipe.joined_batch(batches))["loss"]
    loss.backward()
    return model, float(loss.detach())


def _assert_same_gradients(a: torch.nn.Module, b: torch.nn.Module) -> None:
    grads_b = dict(b.named_parameters())
    trained = [name for name, p in a.named_parameters() if p.grad is not None]
    assert trained == [name for name, p in b.named_parameters() if p.grad is not None]
    for name in trained:
        assert torch.allclose(dict(a.named_parameters())[name].grad, grads_b[name].grad, rtol=1e-4, atol=1e-6), name


def test_dropout_draws_the_same_masks_in_the_cached_and_the_re_run_forward():
    """Dropout 0.5 in both branches: the step's gradients are those of the micro-batches run once,
    in order, from the same random state (and the step checked that the re-run embeddings are the
    cached ones, or it would have raised)."""
    recipe = _two_branch("model.dropout=0.5", "model.batchnorm=none")
    batches = _two_branch_batches(recipe, 2)
    cached, logged = _cached_step(recipe, batches, seed=7)
    direct, loss = _direct(recipe, batches, seed=7)
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    _assert_same_gradients(cached, direct)
    _, other_masks = _direct(recipe, batches, seed=8)
    assert abs(other_masks - loss) > 1e-3  # the masks matter: another seed, another loss


def test_a_forward_that_draws_outside_the_saved_random_state_is_caught(monkeypatch):
    """Without the saved state put back, the re-run draws other dropout masks: the cached
    gradients would belong to another function, and the step says so instead of training on them."""
    monkeypatch.setattr(negative_cache, "_set_random_state", lambda state, device: None)
    recipe = _two_branch("model.dropout=0.5", "model.batchnorm=none")
    with pytest.raises(RandomStateMismatch, match="Python's random, numpy"):
        _cached_step(recipe, _two_branch_batches(recipe, 2))


class NumpyNoiseRecipe(TwoBranchEmbedRecipe):
    """A forward that adds noise from numpy's generator, which torch's saved state does not cover."""

    def cross_batch_embeddings(self, out: dict) -> dict:
        noise = torch.from_numpy(np.random.standard_normal(out["image"].shape).astype(np.float32))
        return {"image": out["image"] + noise, "text": out["text"]}


def test_noise_from_numpy_is_caught():
    recipe = NumpyNoiseRecipe(_two_branch("model.dropout=0", "model.batchnorm=none").config, VOCAB, DIM)
    with pytest.raises(RandomStateMismatch, match="cached gradients belong to another function"):
        _cached_step(recipe, _two_branch_batches(recipe, 2))


def test_batchnorm_normalises_each_micro_batch_and_updates_its_statistics_once_per_micro_batch():
    """BatchNorm (model.batchnorm=last): each micro-batch is normalised with its own statistics,
    in both passes, so the step is exactly the direct loss of the micro-batches run one by one;
    the running statistics move once per micro-batch (the pass without gradient leaves them), as
    plain accumulation moves them."""
    recipe = _two_branch("model.dropout=0", "model.batchnorm=last")
    batches = _two_branch_batches(recipe, 2)
    cached, logged = _cached_step(recipe, batches)
    direct, loss = _direct(recipe, batches)
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    _assert_same_gradients(cached, direct)
    buffers = dict(direct.named_buffers())
    norms = [n for n, _ in cached.named_buffers() if n.endswith("num_batches_tracked")]
    assert norms and all(int(dict(cached.named_buffers())[n]) == 2 for n in norms)  # not 4
    for name, buffer in cached.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    # per micro-batch, not the whole batch's statistics: one forward of all 8 images differs
    torch.manual_seed(0)
    whole = recipe.build_model()
    whole(**recipe.forward_inputs(_two_branch_batches(recipe, 1)[0]))
    mean = next(n for n in buffers if n.endswith("running_mean"))
    assert not torch.allclose(dict(whole.named_buffers())[mean], buffers[mean])


# ---------------------------------------------------------------- LAViTeR


def _laviter(phase: str):
    from test_laviter_recipe import recipe_for

    return recipe_for(phase, "train.accumulate_negatives=true", "train.grad_accumulation=2")


def _laviter_batches(recipe, micro_batches: int) -> list[dict]:
    """8 images with captions of 3-8 words: each micro-batch pads its words to its own longest."""
    from test_laviter_recipe import CAPTIONS

    torch.manual_seed(0)
    captions = [" ".join(CAPTIONS[i % 4].split()[: 3 + i % 6]) for i in range(8)]
    samples = [
        {
            "image": torch.rand(3, 64, 64) * 2 - 1,
            "words": recipe.words(c),
            "tokens": recipe.vocab.encode(c, recipe.config.data.max_caption_len),
        }
        for c in captions
    ]
    m = len(samples) // micro_batches
    return [recipe.collate_train(samples[k * m : (k + 1) * m]) for k in range(micro_batches)]


def test_laviter_vta_takes_damsm_over_every_micro_batch():
    """Phase vta (DAMSM alone; its text encoder has dropout, its frozen trunk's BatchNorm runs
    in eval mode): the step is the DAMSM of all micro-batches' features concatenated."""
    recipe = _laviter("vta")
    check_supported(recipe.config, recipe)
    batches = _laviter_batches(recipe, 2)
    cached, logged = _cached_step(recipe, batches, seed=3)
    direct, loss = _direct(recipe, batches, seed=3)
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    _assert_same_gradients(cached, direct)
    torch.manual_seed(3)  # the same features, DAMSM within each micro-batch: another loss
    with torch.no_grad():
        features = [recipe.cross_batch_embeddings(direct(**recipe.forward_inputs(b))) for b in batches]
        plain = [recipe.cross_batch_losses(f, b)["loss"] for f, b in zip(features, batches, strict=True)]
    assert abs(float(sum(plain)) / 2 - loss) > 1e-2 * loss


def test_laviter_phases_with_gan_updates_are_refused():
    recipe = _laviter("joint")
    with pytest.raises(ConfigError, match="phase joint alternates GAN updates.*model.phase=vta"):
        check_supported(recipe.config, recipe)


def test_a_laviter_job_of_every_phase_is_refused_before_its_first_phase_trains():
    from test_laviter_recipe import TINY

    from vldist.recipes.laviter import LAViTeRRecipe

    config = load_config("laviter", [*TINY, "train.accumulate_negatives=true", "train.grad_accumulation=2"])
    with pytest.raises(ConfigError, match="model.phase=all: phase assist alternates GAN updates"):
        LAViTeRRecipe.stages(config)
    vta_only = load_config(
        "laviter", [*TINY, "train.accumulate_negatives=true", "model.assist_epochs=0", "model.joint_epochs=0"]
    )
    assert [name for name, _ in LAViTeRRecipe.stages(vta_only)][-1] == "vta"


# ---------------------------------------------------------------- refusals


def test_recipes_whose_objective_does_not_split_are_refused_with_the_reason():
    config = load_config("two_branch_sim", ["train.accumulate_negatives=true", "train.grad_accumulation=2"])
    with pytest.raises(ConfigError, match="fusion layers.*use two_branch_embed"):
        check_supported(config, TwoBranchSimRecipe(config, VOCAB, DIM))
    phrases = _two_branch("model.tasks=[phrases]", "train.accumulate_negatives=true")
    with pytest.raises(ConfigError, match=r"phrase localisation.*model.tasks=\[retrieval\]"):
        check_supported(phrases.config, phrases)
    check_supported(_two_branch().config, _two_branch())  # retrieval: supported


def test_train_compile_step_is_refused_and_compile_model_allowed():
    recipe = worker.make_recipe("accelerate", 2, "train.compile=step")
    with pytest.raises(ConfigError, match="train.compile=model"):
        check_supported(recipe.config, recipe)
    check_supported(worker.make_recipe("accelerate", 2, "train.compile=model").config, recipe)


# ---------------------------------------------------------------- with activation checkpointing


@pytest.mark.parametrize("rrr_layers", [0, 1])
def test_activation_checkpointing_inside_the_cached_step_changes_neither_loss_nor_gradient(monkeypatch, rrr_layers):
    """The re-run forward recomputes its checkpointed blocks (VSRN's decoder per step; with an RRR
    layer, its BatchNorm too) in the backward of the cached gradients: the same step as without."""
    from vldist.training.activation_checkpointing import checkpoint_blocks, is_checkpointed

    recipe = worker.make_recipe("accelerate", 2, f"model.rrr_layers={rrr_layers}")
    plain = worker.cached_step(cpu_engine(), recipe, 2)
    build, checkpointed = base.build_model, []

    def build_checkpointed(recipe):
        model = build(recipe)
        checkpoint_blocks(model, recipe.checkpointed_blocks(model))
        checkpointed.extend(name for name, m in model.named_modules() if is_checkpointed(m))
        return model

    monkeypatch.setattr(base, "build_model", build_checkpointed)
    again = worker.cached_step(cpu_engine(), recipe, 2)
    assert checkpointed
    assert again["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    for name, grad in plain["grads"].items():
        if re.fullmatch(r"image\.rrr\.\d+\.w_r\.bias", name):
            # a bias BatchNorm follows: its gradient is zero but for the rounding of terms that
            # cancel, which the plain step's written-out decoder loop and the checkpointed step's
            # autograd loop round differently (models/attention_gru_loop.py)
            assert again["grads"][name].abs().max() < 1e-3 and grad.abs().max() < 1e-3, name
            continue
        # fp32 rounding of the tensor's sums, on the scale of its largest entry: an entry that sums
        # terms of either sign can differ in its low bits by more than rtol of itself
        scale = float(grad.abs().max())
        assert torch.allclose(again["grads"][name], grad, rtol=1e-5, atol=max(1e-7, 1e-6 * scale)), name
