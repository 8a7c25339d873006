"""The cl_caption recipe: frozen reference, global negatives, the loss of Eq. 10, its two stages."""

import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from vldist.checkpoint.format import load_model_state, save_checkpoint
from vldist.checkpoint.starting_weights import read_starting_weights
from vldist.config import to_yaml
from vldist.data.vocab import Vocab
from vldist.errors import ConfigError, IncompatibleCheckpoint
from vldist.losses import contrastive_captioning_loss
from vldist.recipes import get_recipe
from vldist.recipes.captioner import CaptionerRecipe
from vldist.recipes.cl_caption import CLCaptionConfig, CLCaptionModel, CLCaptionRecipe
from vldist.recipes.jobs import load_config
from vldist.shards.convert.images import one_thread
from vldist.training.optimizers import build_optimizers

VOCAB = Vocab(["a", "red", "circle", "blue", "square", "green", "star", "small"])
DIM = 6
TINY = ["model.hidden=8", "model.embed=8", "data.max_regions=4", "data.vocab_min_count=1"]


def _captioner_checkpoint(directory: Path, *overrides: str, seed: int = 0) -> Path:
    """A captioner checkpoint as the MLE stage leaves it (random weights: nothing here needs training)."""
    config = load_config("captioner", [*TINY, *overrides])
    torch.manual_seed(seed)
    model = CaptionerRecipe(config, VOCAB, DIM).build_model()
    return save_checkpoint(
        directory,
        model_state=model.state_dict(),
        train_state={},
        config_yaml=to_yaml(config),
        vocab=VOCAB,
        meta={"step": 1},
    )


def _started(recipe):
    """The model as training starts it: built, then its starting weights loaded."""
    model = recipe.build_model()
    recipe.initialize(model, read_starting_weights(recipe.starts_from()), None)
    return model


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine two threads wait on each
    other (measured: 60x slower); the caller's setting comes back after the module."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def captioner(tmp_path_factory) -> Path:
    return _captioner_checkpoint(tmp_path_factory.mktemp("mle") / "best")


def _recipe(init_from, *overrides: str) -> CLCaptionRecipe:
    init = [f"model.init_from={init_from}"] if init_from else []
    config = load_config("cl_caption", [*TINY, "model.dropout=0", "model.negatives=3", *init, *overrides])
    return CLCaptionRecipe(config, VOCAB, DIM)


def _batch(recipe: CLCaptionRecipe, n_images: int = 5, seed: int = 0) -> dict:
    """n_images images with 1-3 captions each (uneven on purpose), of 1-5 words."""
    rng = np.random.default_rng(seed)
    words = VOCAB.itos[4:]
    samples = []
    for i in range(n_images):
        captions = [" ".join(rng.choice(words, size=1 + (i + j) % 5)) for j in range(1 + i % 3)]
        samples.append(
            {
                "regions": rng.standard_normal((2 + i % 3, DIM)).astype(np.float32),
                "captions": [VOCAB.encode(c) for c in captions],
            }
        )
    return recipe.collate_train(samples)


def _sentence_logprob(captioner, regions, mask, tokens) -> torch.Tensor:
    """ln p(caption | image), one caption at a time, from the teacher-forced logits: the test's own."""
    tokens = tokens[: int((tokens != 0).sum())]
    with torch.no_grad():
        logprobs = captioner(regions[None], mask[None], tokens[None])[0].log_softmax(-1)
    return logprobs[torch.arange(len(tokens) - 1), tokens[1:]].sum()


# ---------------------------------------------------------------------------- the frozen reference


def test_the_reference_never_trains_and_stays_in_eval_mode(captioner):
    recipe = _recipe(captioner, "model.dropout=0.5")
    model = _started(recipe)
    reference = {k: v.clone() for k, v in model.reference.state_dict().items()}
    target = {k: v.clone() for k, v in model.target.state_dict().items()}
    for key in reference:  # both start from the captioner's weights
        assert torch.equal(reference[key], target[key])
    optimizers = build_optimizers(recipe.config, recipe.optimizer_groups(model))
    in_groups = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    assert not in_groups & {id(p) for p in model.reference.parameters()}
    assert in_groups == {id(p) for p in model.target.parameters()}
    batch = _batch(recipe)

    model.train()
    assert model.training and model.target.training and all(m.training for m in model.target.modules())
    assert not any(m.training for m in model.reference.modules())  # its dropout is off
    for step in range(3):
        recipe.start_step(step)
        for name in recipe.updates(step):
            recipe.training_losses(model, batch, name)["loss"].backward()
            assert all(p.grad is None for p in model.reference.parameters())
            optimizers[name].step()
            optimizers[name].zero_grad()
    assert not any(m.training for m in model.reference.modules())
    for key, value in model.reference.state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert any(not torch.equal(v, target[k]) for k, v in model.target.state_dict().items())  # the target trained
    # dropout on in the target (as the official code), off in the reference: G != 0 at equal weights
    rows = batch["caption_images"]
    args = (batch["regions"][rows], batch["mask"][rows], batch["tokens"])
    assert not torch.equal(model.target(*args), model.target(*args))
    assert torch.equal(model.reference(*args), model.reference(*args))


class _Wrapper(torch.nn.Module):
    """What DDP looks like to the recipe: the model under `.module`, called through the wrapper."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_the_reference_becomes_the_target_once_at_each_replacement_step(captioner):
    recipe = _recipe(captioner, "model.replace_reference_every=2")
    module = _started(recipe)
    model = _Wrapper(module)
    optimizer = build_optimizers(recipe.config, recipe.optimizer_groups(model))["main"]
    batch = _batch(recipe)

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))

    for step in range(3):
        recipe.start_step(step)
        losses = recipe.training_losses(model, batch)
        if step == 2:  # replaced before this step's forward: G = 0 for every pair (dropout 0)
            assert same(module.reference, module.target)
            assert float(losses["g_pos"]) == 0 and float(losses["g_neg"]) == 0
            assert losses["loss"].item() == pytest.approx(2 * math.log(2))
            with torch.no_grad():  # a second micro-batch of the same step must not copy again
                next(module.target.parameters()).add_(1.0)
            recipe.training_losses(model, batch)
            assert not same(module.reference, module.target)
        else:
            assert not same(module.reference, module.target) or step == 0  # they start equal
        losses["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    recipe.start_step(3)
    recipe.training_losses(model, batch)
    assert not same(module.reference, module.target)  # not a replacement step


# ---------------------------------------------------------------------------- negatives and the loss


def test_negatives_come_from_other_images_and_are_redrawn_every_step(captioner):
    recipe = _recipe(captioner, "model.negatives=4")
    model = _started(recipe)
    batch = _batch(recipe, n_images=4)
    own = batch["caption_images"]
    draws = []
    for step in range(6):
        recipe.start_step(step)
        recipe.training_losses(model, batch)
        draw = recipe.last_draw
        assert draw["offset"] == 0 and torch.equal(draw["image_ids"], own)  # one process: ids are the rows
        assert draw["draw"].shape == (4, len(own))
        assert (draw["image_ids"][draw["draw"]] != own[None]).all()
        draws.append(draw["draw"])
    assert all(not torch.equal(a, b) for a, b in pairwise(draws))
    seen = torch.stack(draws).flatten(0, 1)  # every other image's captions get drawn at some point
    for t in range(len(own)):
        assert set(own[seen[:, t]].tolist()) == set(own.tolist()) - {int(own[t])}
    recipe.start_step(2)
    recipe.training_losses(model, batch)
    assert torch.equal(recipe.last_draw["draw"], draws[2])  # the draw is a function of (seed, step)
    import pickle  # loader workers get the recipe pickled (data/pipeline.py): not the step's tensors

    copy = pickle.loads(pickle.dumps(recipe))
    assert copy.last_draw is None and recipe.last_draw is not None and copy.vocab.itos == recipe.vocab.itos


@pytest.mark.parametrize("terms", ["full", "positive", "negative"])
def test_the_loss_is_eq10_on_independently_computed_sentence_logprobs(captioner, terms):
    # the target moved away from the reference, so G spans both signs
    recipe = _recipe(captioner, f"model.terms={terms}", "model.nu=0.7")
    model = _started(recipe)
    with torch.no_grad():
        for p in model.target.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batch = _batch(recipe, n_images=5)
    calls = []
    model.target.decoder.register_forward_hook(lambda m, args, out: calls.append(args[2].shape[0]))
    recipe.start_step(4)
    losses = recipe.training_losses(model, batch)
    recipe_calls = list(calls)  # the recipe's decoder passes, not the test's own below

    rows, tokens = batch["caption_images"], batch["tokens"]
    n = len(rows)

    def logprobs(captioner_model, caption_rows, image_rows):
        return torch.stack(
            [
                _sentence_logprob(captioner_model, batch["regions"][i], batch["mask"][i], tokens[c])
                for c, i in zip(caption_rows.tolist(), image_rows.tolist(), strict=True)
            ]
        )

    pos_t, pos_r = logprobs(model.target, torch.arange(n), rows), logprobs(model.reference, torch.arange(n), rows)
    if terms == "positive":  # CL(P): no negative pass at all
        assert recipe.last_draw is None and recipe_calls == [n]
        neg_t = neg_r = torch.zeros(0, n)
        assert set(losses) == {"loss", "g_pos"}
    else:
        draw = recipe.last_draw["draw"]
        assert recipe_calls == [4 * n]  # positives and K = 3 negative sets in one pass
        neg_t = torch.stack([logprobs(model.target, draw[k], rows) for k in range(3)])
        neg_r = torch.stack([logprobs(model.reference, draw[k], rows) for k in range(3)])
        assert float(losses["g_neg"]) == pytest.approx(float((neg_t - neg_r).mean()), rel=1e-5)
    expected = contrastive_captioning_loss(pos_t, pos_r, neg_t, neg_r, nu=0.7, terms=terms)
    assert abs(float(expected)) > 0.1
    assert losses["loss"].item() == pytest.approx(float(expected), rel=1e-5)
    assert float(losses["g_pos"]) == pytest.approx(float((pos_t - pos_r).mean()), rel=1e-5)
    assert float((pos_t - pos_r).abs().min()) > 0 or terms == "negative"


# ---------------------------------------------------------------------------- building the model


def test_the_model_needs_a_captioner_to_start_from(captioner, tmp_path):
    with pytest.raises(ConfigError, match=r"python -m vldist.train cl_caption.*captioner_run"):
        _started(_recipe(None))
    other = _captioner_checkpoint(tmp_path / "wide", "model.hidden=12")
    with pytest.raises(IncompatibleCheckpoint, match=r"model.hidden: checkpoint 12, this job 8"):
        _started(_recipe(other))
    with pytest.raises(IncompatibleCheckpoint, match="vocabulary"):
        _started(CLCaptionRecipe(_recipe(captioner).config, Vocab(["a", "red"]), DIM))

    recipe = _recipe(captioner)
    model = _started(recipe)
    assert isinstance(model, CLCaptionModel) and model.decoder is model.target.decoder
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    assert all(torch.equal(v, first[k]) for k, v in _started(recipe).state_dict().items())  # deterministic
    saved = _started(_recipe(captioner)).target.state_dict()
    for key, value in load_model_state(captioner).items():
        assert torch.equal(saved[key], value)
    captions = recipe.caption(model, [np.ones((3, DIM), np.float32)], torch.device("cpu"))
    assert len(captions) == 1  # generation runs on the target's decoder
    assert get_recipe("cl_caption") is CLCaptionRecipe

    # Table 6's next round: a CL run's target starts both; another recipe's checkpoint is refused
    with torch.no_grad():
        for p in model.target.parameters():
            p.add_(1.0)
    cl_run = save_checkpoint(
        tmp_path / "cl" / "checkpoints" / "best",
        model_state=model.state_dict(),
        train_state={},
        config_yaml=to_yaml(recipe.config),
        vocab=VOCAB,
        meta={},
    )
    again = _started(_recipe(cl_run.parent.parent))
    for key, value in model.target.state_dict().items():
        assert torch.equal(again.target.state_dict()[key], value) and torch.equal(
            again.reference.state_dict()[key], value
        )
    vsrn = save_checkpoint(
        tmp_path / "vsrn",
        model_state={},
        train_state={},
        vocab=VOCAB,
        meta={},
        config_yaml=to_yaml(load_config("vsrn", [])),
    )
    with pytest.raises(IncompatibleCheckpoint, match="'vsrn' checkpoint, not a captioner's"):
        _started(_recipe(vsrn))


# ---------------------------------------------------------------------------- stages


def test_stages_train_the_captioner_then_cl_from_its_best_checkpoint(tmp_path):
    config = load_config(
        "cl_caption",
        [
            f"output.dir={tmp_path}/run",
            "seed=7",
            "data.shards=/data/coco",
            "metrics.port=9500",
            "ray.num_workers=3",
            "launcher=local",
            "engine.sync_batchnorm=true",
            "model.negatives=4",
        ],
    )
    (mle_name, mle), (cl_name, cl) = CLCaptionRecipe.stages(config)
    assert (mle_name, cl_name) == ("mle", "cl")
    captioner = load_config("captioner", [])
    assert mle.recipe == "captioner" and isinstance(mle.model, type(captioner.model))
    assert mle.model == captioner.model and mle.train == captioner.train and mle.eval == captioner.eval
    assert mle.data == captioner.data.model_copy(update={"shards": "/data/coco"})
    assert (mle.seed, mle.launcher, mle.metrics.port, mle.ray.num_workers) == (7, "local", 9500, 3)
    assert mle.engine == config.engine and mle.engine.sync_batchnorm
    assert mle.output_dir == tmp_path / "run" / "mle"

    assert cl.recipe == "cl_caption" and isinstance(cl.model, CLCaptionConfig)
    assert cl.output_dir == tmp_path / "run" / "cl"
    assert cl.model.init_from == str(tmp_path / "run" / "mle" / "checkpoints" / "best")
    assert cl.eval.baseline is False
    assert cl.model.negatives == 4 and cl.train == config.train and cl.data == config.data
    type(cl).model_validate(cl.model_dump())  # the result validates

    with pytest.raises(ConfigError, match="model.hidden"):  # caught before the MLE stage, not after it
        CLCaptionRecipe.stages(load_config("cl_caption", ["model.hidden=64"]))


def test_stages_reuse_a_captioner_run(tmp_path):
    run = tmp_path / "old_captioner"
    best = _captioner_checkpoint(run / "checkpoints" / "best")
    config = load_config("cl_caption", [f"output.dir={tmp_path}/cl_run", f"model.captioner_run={run}"])
    stages = CLCaptionRecipe.stages(config)
    assert [name for name, _ in stages] == ["cl"]
    cl = stages[0][1]
    assert cl.model.init_from == str(run) and cl.output_dir == tmp_path / "cl_run" / "cl"
    assert read_starting_weights(CLCaptionRecipe(cl, VOCAB, DIM).starts_from()).path == best  # its best checkpoint
    assert cl.eval.baseline == config.eval.baseline  # no MLE stage: the reused captioner is the baseline
