"""LAViTeR's recipe: the phases freeze exactly what they say, the discriminators and the rest each
step only their own parameters, the stages chain the phases, and the pieces between the captioner
and the text encoder."""

import random

import pytest
import torch

from vldist.data.vocab import Vocab
from vldist.models.laviter import caption_words
from vldist.recipes.laviter import LAViTeRRecipe, attribute_texts
from vldist.train import load_config

TINY = ["model.embed_dim=32", "model.text_heads=2", "model.gf_dim=4", "model.df_dim=4", "model.itm_dim=32",
        "model.itm_heads=2", "model.itm_encoder_layers=1", "model.itm_decoder_layers=1", "model.itm_feedforward=32",
        "model.z_dim=8", "model.condition_dim=8", "model.residual_blocks=1", "data.max_caption_len=12",
        "model.max_words=8"]
CAPTIONS = ["a small red circle left of a blue square", "a large green star", "two pink diamonds and a black star",
            "a purple triangle above an orange hexagon"]


def recipe_for(phase: str, *overrides: str) -> LAViTeRRecipe:
    config = load_config("laviter", [*TINY, f"model.phase={phase}", *overrides])
    return LAViTeRRecipe(config, Vocab.build(CAPTIONS))


def batch_for(recipe: LAViTeRRecipe, n: int = 4) -> dict:
    rng = random.Random(0)
    torch.manual_seed(0)
    samples = []
    for i in range(n):
        caption = CAPTIONS[i % len(CAPTIONS)]
        samples.append({"image": torch.rand(3, 64, 64) * 2 - 1, "words": recipe.words(caption),
                        "tokens": recipe.vocab.encode(caption, recipe.config.data.max_caption_len)})
    rng.shuffle(samples)
    return recipe.collate_train(samples)


def snapshot(model, parameters_only: bool = False) -> dict[str, torch.Tensor]:
    items = model.named_parameters() if parameters_only else model.state_dict().items()
    return {k: v.detach().clone() for k, v in items}


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])}


def train_steps(recipe: LAViTeRRecipe, model, batch: dict, steps: int = 2) -> None:
    """What the trainer does each step: every update its own forward and backward, gradients of
    other optimizers' parameters cleared first."""
    optimizers = {name: torch.optim.Adam(params, lr=1e-2) for name, params in recipe.optimizer_groups(model).items()}
    model.train()
    for step in range(steps):
        for update in recipe.updates(step):
            model.zero_grad(set_to_none=True)
            recipe.losses(model, batch, update)["loss"].backward()
            optimizers[update].step()


def under(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if n.startswith(prefixes)}


def test_phase_1_trains_the_text_encoder_and_the_image_projections_only():
    recipe = recipe_for("vta")
    model = recipe.build_model()
    before = snapshot(model)
    train_steps(recipe, model, batch_for(recipe))
    moved = changed(before, snapshot(model))
    # the trunk, its batch-norm statistics included, and the assisting models stay as they were
    assert not under(moved, "image_encoder.blocks", "generator", "discriminators", "captioner"), moved
    assert under(moved, "image_encoder.local_projection") and under(moved, "image_encoder.global_projection")
    assert under(moved, "text_encoder.")
    assert recipe.updates(0) == ("main",)


def test_phase_1_with_a_trainable_trunk_moves_it():
    recipe = recipe_for("vta", "model.vta_trunk=trainable")
    model = recipe.build_model()
    before = snapshot(model)
    train_steps(recipe, model, batch_for(recipe))
    moved = changed(before, snapshot(model))
    assert "image_encoder.blocks.0.1.running_mean" in moved and "image_encoder.blocks.0.0.weight" in moved


def test_phase_2_trains_generation_and_captioning_on_frozen_encoders():
    recipe = recipe_for("assist")
    model = recipe.build_model()
    before = snapshot(model)
    train_steps(recipe, model, batch_for(recipe))
    moved = changed(before, snapshot(model))
    assert not under(moved, "image_encoder", "text_encoder"), moved
    for module in ("generator.", "discriminators.", "captioner."):
        assert under(moved, module), module
    assert recipe.updates(0) == ("discriminator", "main")


def test_phase_3_freezes_the_first_blocks_and_their_batch_norm_only():
    recipe = recipe_for("joint")
    model = recipe.build_model()
    blocks = len(model.image_encoder.blocks)
    before = snapshot(model)
    train_steps(recipe, model, batch_for(recipe))
    moved = changed(before, snapshot(model))
    frozen = tuple(f"image_encoder.blocks.{i}." for i in range(5))
    assert not under(moved, *frozen), under(moved, *frozen)
    for i in range(5, blocks):  # weights and running statistics of the later blocks move
        assert f"image_encoder.blocks.{i}.0.weight" in moved and f"image_encoder.blocks.{i}.1.running_mean" in moved
    for module in ("text_encoder.", "generator.", "discriminators.", "captioner.", "image_encoder.global_projection"):
        assert under(moved, module), module
    # frozen blocks stay in eval mode whatever the trainer sets
    model.train()
    assert not model.image_encoder.blocks[0].training and model.image_encoder.blocks[5].training


@pytest.mark.parametrize("phase", ["assist", "joint"])
def test_discriminator_and_generator_updates_step_only_their_own_parameters(phase):
    recipe = recipe_for(phase)
    model = recipe.build_model()
    groups = recipe.optimizer_groups(model)
    optimizers = {name: torch.optim.Adam(params, lr=1e-2) for name, params in groups.items()}
    own = {name: {id(p) for group in params for p in (group["params"] if isinstance(group, dict) else [group])}
           for name, params in groups.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert own["discriminator"].isdisjoint(own["main"]) and own["discriminator"] | own["main"] == trainable
    assert {names[i] for i in own["discriminator"]} == {n for n, _ in model.discriminators.named_parameters(
        prefix="discriminators")}
    batch = batch_for(recipe)
    model.train()
    for update in recipe.updates(0):
        model.zero_grad(set_to_none=True)
        before = snapshot(model, parameters_only=True)
        recipe.losses(model, batch, update)["loss"].backward()
        if update == "discriminator":  # the generated images are detached: no gradient reaches G
            assert all(p.grad is None for p in model.generator.parameters())
        optimizers[update].step()
        moved = {id(p) for n, p in model.named_parameters() if not torch.equal(before[n], p)}
        assert moved and moved <= own[update], {names[i] for i in moved - own[update]}


def test_stages_chain_the_phases_from_each_best_checkpoint():
    config = load_config("laviter", ["output.dir=runs/x", "model.vta_epochs=2", "model.assist_epochs=1",
                                     "model.joint_epochs=3"])
    stages = LAViTeRRecipe.stages(config)
    assert [name for name, _ in stages] == ["vta", "assist", "joint"]
    vta, assist, joint = (stage for _, stage in stages)
    assert [s.model.phase for s in (vta, assist, joint)] == ["vta", "assist", "joint"]
    assert [s.train.epochs for s in (vta, assist, joint)] == [2, 1, 3]
    assert [s.train.lr for s in (vta, assist, joint)] == [config.model.vta_lr, config.model.assist_lr,
                                                          config.model.joint_lr]
    assert vta.model.init_from is None
    assert assist.model.init_from == "runs/x/vta"  # its best checkpoint, else its last
    assert joint.model.init_from == "runs/x/assist"
    assert [s.eval.baseline for s in (vta, assist, joint)] == [True, False, False]  # one untrained row


def test_stages_leave_out_phases_without_epochs_or_models():
    vta_only = load_config("laviter", ["model.assist_epochs=0", "model.joint_epochs=0"])
    assert [name for name, _ in LAViTeRRecipe.stages(vta_only)] == ["vta"]
    no_assist = load_config("laviter", ["model.tim=false", "model.itm=false"])
    assert [name for name, _ in LAViTeRRecipe.stages(no_assist)] == ["vta", "joint"]
    alone = load_config("laviter", ["model.phase=joint"])
    assert [name for name, _ in LAViTeRRecipe.stages(alone)] == ["joint"]


def test_phase_weights():
    assert recipe_for("vta").weights() == {"damsm": 1.0}
    assist = recipe_for("assist").weights()
    assert assist["damsm"] == 0 and assist["fake_text"] == 0 and assist["generator"] > 0 and assist["caption"] > 0
    joint = recipe_for("joint", "model.weight_damsm=50", "model.itm=false").weights()
    assert joint["damsm"] == 50 and joint["caption"] == 0 and joint["fake_text"] == 0 and joint["fake_image"] == 1


def test_generated_ids_become_the_text_encoders_words():
    end = 2
    ids = torch.tensor([[5, 6, end, 7, 0], [end, 4, 4, 4, 4], [8, 9, 10, 11, 12]])
    words, lengths = caption_words(ids, end, max_words=4)
    assert lengths.tolist() == [2, 1, 4]  # an empty caption reads as one padding word
    assert words.tolist() == [[5, 6, 0, 0], [0, 0, 0, 0], [8, 9, 10, 11]]


def test_attribute_texts_of_a_scene_and_of_annotated_data():
    meta = {"objects": [{"phrase": "a large black star", "size": "large", "color": "black", "shape": "star"},
                        {"phrase": "a small black circle", "size": "small", "color": "black", "shape": "circle"}]}
    assert attribute_texts(meta) == ["a large black star", "large", "black", "star", "a small black circle", "small",
                                     "circle"]
    assert attribute_texts({"attributes": ["has wing color blue"], "objects": meta["objects"]}) == ["has wing color blue"]
    assert attribute_texts({"captions": ["x"]}) == []
