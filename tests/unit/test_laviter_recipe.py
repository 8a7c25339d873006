"""LAViTeR's recipe: the phases freeze exactly what they say, the discriminators and the rest each
step only their own parameters, the stages chain the phases, and the pieces between the captioner
and the text encoder."""

import random

import pytest
import torch

from vldist.data.vocab import Vocab
from vldist.models.laviter import caption_words
from vldist.recipes.jobs import load_config
from vldist.recipes.laviter import LAViTeRRecipe, attribute_texts

TINY = [
    "model.embed_dim=32",
    "model.text_heads=2",
    "model.gf_dim=4",
    "model.df_dim=4",
    "model.itm_dim=32",
    "model.itm_heads=2",
    "model.itm_encoder_layers=1",
    "model.itm_decoder_layers=1",
    "model.itm_feedforward=32",
    "model.z_dim=8",
    "model.condition_dim=8",
    "model.residual_blocks=1",
    "data.max_caption_len=12",
    "model.max_words=8",
]
CAPTIONS = [
    "a small red circle left of a blue square",
    "a large green star",
    "two pink diamonds and a black star",
    "a purple triangle above an orange hexagon",
]


def recipe_for(phase: str, *overrides: str) -> LAViTeRRecipe:
    config = load_config("laviter", [*TINY, f"model.phase={phase}", *overrides])
    return LAViTeRRecipe(config, Vocab.build(CAPTIONS))


def batch_for(recipe: LAViTeRRecipe, n: int = 4) -> dict:
    rng = random.Random(0)
    torch.manual_seed(0)
    samples = []
    for i in range(n):
        caption = CAPTIONS[i % len(CAPTIONS)]
        samples.append(
            {
                "image": torch.rand(3, 64, 64) * 2 - 1,
                "words": recipe.words(caption),
                "tokens": recipe.vocab.encode(caption, recipe.config.data.max_caption_len),
            }
        )
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
            recipe.training_losses(model, batch, update)["loss"].backward()
            optimizers[update].step()


def under(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if n.startswith(prefixes)}


def moved_by_training(recipe: LAViTeRRecipe, model, batch: dict | None = None) -> set[str]:
    """The floating-point state entries (weights and batch-norm statistics) that two training steps change."""
    before = snapshot(model)
    train_steps(recipe, model, batch if batch is not None else batch_for(recipe))
    return changed(before, snapshot(model))


def test_trunk_pretraining_trains_the_trunk_and_its_label_head_only():
    recipe = recipe_for("pretrain")
    model = recipe.build_model()
    batch = batch_for(recipe)
    objects = [{"color": "red", "shape": "circle", "size": "small"}, {"color": "blue", "shape": "square"}]
    batch["labels"] = torch.zeros(4, len(recipe.vocab))
    batch["labels"][:, recipe.labels({"objects": objects})] = 1.0
    assert sorted(recipe.vocab.itos[i] for i in recipe.labels({"objects": objects})) == [
        "blue",
        "circle",
        "red",
        "small",
        "square",
    ]
    moved = moved_by_training(recipe, model, batch)
    assert under(moved, "image_encoder.blocks.0.") and under(moved, "label_head.")
    assert not under(
        moved,
        "image_encoder.local_projection",
        "image_encoder.global_projection",
        "text_encoder",
        "generator",
        "discriminators",
        "captioner",
    ), moved
    # the next phase takes the trunk and leaves the head behind
    vta = recipe_for("vta").build_model()
    state = {k: v for k, v in model.state_dict().items()}
    missing, unexpected = vta.load_state_dict(state, strict=False)
    assert not missing and set(unexpected) == {"label_head.weight", "label_head.bias"}


def test_phase_1_trains_the_text_encoder_and_the_image_projections_only():
    recipe = recipe_for("vta")
    model = recipe.build_model()
    moved = moved_by_training(recipe, model)
    # the trunk, its batch-norm statistics included, and the assisting models stay as they were
    assert not under(moved, "image_encoder.blocks", "generator", "discriminators", "captioner"), moved
    assert under(moved, "image_encoder.local_projection") and under(moved, "image_encoder.global_projection")
    assert under(moved, "text_encoder.")
    assert recipe.updates(0) == ("main",)


def test_phase_1_with_a_trainable_trunk_moves_it():
    recipe = recipe_for("vta", "model.vta_trunk=trainable")
    model = recipe.build_model()
    moved = moved_by_training(recipe, model)
    assert "image_encoder.blocks.0.1.running_mean" in moved and "image_encoder.blocks.0.0.weight" in moved


def test_phase_2_trains_generation_and_captioning_on_frozen_encoders():
    recipe = recipe_for("assist")
    model = recipe.build_model()
    moved = moved_by_training(recipe, model)
    assert not under(moved, "image_encoder", "text_encoder"), moved
    for module in ("generator.", "discriminators.", "captioner."):
        assert under(moved, module), module
    assert recipe.updates(0) == ("discriminator", "main")


def test_phase_3_freezes_the_first_blocks_and_their_batch_norm_only():
    recipe = recipe_for("joint")
    model = recipe.build_model()
    blocks = len(model.image_encoder.blocks)
    moved = moved_by_training(recipe, model)
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
    own = {
        name: {id(p) for group in params for p in (group["params"] if isinstance(group, dict) else [group])}
        for name, params in groups.items()
    }
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert own["discriminator"].isdisjoint(own["main"]) and own["discriminator"] | own["main"] == trainable
    assert {names[i] for i in own["discriminator"]} == {
        n for n, _ in model.discriminators.named_parameters(prefix="discriminators")
    }
    batch = batch_for(recipe)
    model.train()
    for update in recipe.updates(0):
        model.zero_grad(set_to_none=True)
        before = snapshot(model, parameters_only=True)
        recipe.training_losses(model, batch, update)["loss"].backward()
        if update == "discriminator":  # the generated images are detached: no gradient reaches G
            assert all(p.grad is None for p in model.generator.parameters())
        optimizers[update].step()
        moved = {id(p) for n, p in model.named_parameters() if not torch.equal(before[n], p)}
        assert moved and moved <= own[update], {names[i] for i in moved - own[update]}


def test_stages_chain_the_phases_from_each_best_checkpoint():
    config = load_config(
        "laviter",
        [
            "output.dir=runs/x",
            "model.pretrain_epochs=4",
            "model.vta_epochs=2",
            "model.assist_epochs=1",
            "model.joint_epochs=3",
        ],
    )
    stages = LAViTeRRecipe.stages(config)
    assert [name for name, _ in stages] == ["pretrain", "vta", "assist", "joint"]
    pretrain, vta, assist, joint = (stage for _, stage in stages)
    assert [s.model.phase for s in (pretrain, vta, assist, joint)] == ["pretrain", "vta", "assist", "joint"]
    assert [s.train.epochs for s in (pretrain, vta, assist, joint)] == [4, 2, 1, 3]
    m = config.model
    assert [s.train.lr for s in (pretrain, vta, assist, joint)] == [m.pretrain_lr, m.vta_lr, m.assist_lr, m.joint_lr]
    assert pretrain.model.init_from is None
    assert vta.model.init_from == "runs/x/pretrain"  # its best checkpoint, else its last
    assert assist.model.init_from == "runs/x/vta"
    assert joint.model.init_from == "runs/x/assist"
    assert [s.eval.baseline for s in (pretrain, vta, assist, joint)] == [True, False, False, False]  # one untrained row
    # a trunk with weights of its own (the paper's Inception) is not pretrained again
    weighted = load_config("laviter", ["model.pretrain_epochs=4", "model.image_weights=x.pt"])
    assert [name for name, _ in LAViTeRRecipe.stages(weighted)][0] == "vta"


def test_stages_leave_out_phases_without_epochs_or_models():
    vta_only = load_config("laviter", ["model.pretrain_epochs=0", "model.assist_epochs=0", "model.joint_epochs=0"])
    assert [name for name, _ in LAViTeRRecipe.stages(vta_only)] == ["vta"]
    no_assist = load_config("laviter", ["model.tim=false", "model.itm=false"])
    assert [name for name, _ in LAViTeRRecipe.stages(no_assist)] == ["pretrain", "vta", "joint"]
    alone = load_config("laviter", ["model.phase=joint"])
    assert [name for name, _ in LAViTeRRecipe.stages(alone)] == ["joint"]


def test_phase_weights():
    assert recipe_for("vta", "model.weight_damsm=7").weights() == {"damsm": 7.0}
    assist = recipe_for("assist").weights()
    assert assist["damsm"] == 0 and assist["fake_text"] == 0 and assist["generator"] > 0 and assist["caption"] > 0
    joint = recipe_for("joint", "model.itm=false").weights()
    assert joint["damsm"] == 50 and joint["caption"] == 0 and joint["fake_text"] == 0 and joint["fake_image"] == 1


def test_generated_ids_become_the_text_encoders_words():
    end = 2
    ids = torch.tensor([[5, 6, end, 7, 0], [end, 4, 4, 4, 4], [8, 9, 10, 11, 12]])
    words, lengths = caption_words(ids, end, max_words=4)
    assert lengths.tolist() == [2, 1, 4]  # an empty caption reads as one padding word
    assert words.tolist() == [[5, 6, 0, 0], [0, 0, 0, 0], [8, 9, 10, 11]]


def test_attribute_texts_of_a_scene_and_of_annotated_data():
    meta = {
        "objects": [
            {"phrase": "a large black star", "size": "large", "color": "black", "shape": "star"},
            {"phrase": "a small black circle", "size": "small", "color": "black", "shape": "circle"},
        ]
    }
    assert attribute_texts(meta) == [
        "a large black star",
        "large",
        "black",
        "star",
        "a small black circle",
        "small",
        "circle",
    ]
    assert attribute_texts({"attributes": ["has wing color blue"], "objects": meta["objects"]}) == [
        "has wing color blue"
    ]
    assert attribute_texts({"captions": ["x"]}) == []


def test_generated_images_leave_the_image_encoders_batch_norm_statistics_alone():
    from vldist.models.laviter import running_statistics_kept

    encoder = recipe_for("joint").build_model().image_encoder
    encoder.train()
    before = snapshot(encoder)
    with running_statistics_kept(encoder):
        regions, image = encoder(torch.rand(4, 3, 64, 64) * 2 - 1)
    (regions.sum() + image.sum()).backward()
    assert not changed(before, snapshot(encoder))  # no running mean or variance moved
    assert encoder.blocks[6][0].weight.grad is not None  # the gradient still reaches the encoder
    assert all(m.training for m in encoder.modules())  # and train mode is back
    encoder(torch.rand(4, 3, 64, 64) * 2 - 1)
    assert "blocks.6.1.running_mean" in changed(before, snapshot(encoder))  # real images do move them


def test_one_phase_alone_takes_its_own_epochs_and_learning_rate():
    ((name, stage),) = LAViTeRRecipe.stages(load_config("laviter", ["model.phase=joint", "model.joint_epochs=3"]))
    assert name == "joint" and stage.train.epochs == 3 and stage.train.lr == stage.model.joint_lr


def test_the_captioner_trains_at_its_own_rate_in_phase_2_with_or_without_the_generator():
    for overrides, lrs in (([], [None, 0.123]), (["model.tim=false"], [0.123])):  # the generator's group, if any
        recipe = recipe_for("assist", "model.itm_lr=0.123", *overrides)
        groups = recipe.optimizer_groups(recipe.build_model())["main"]
        assert [g.get("lr") for g in groups] == lrs, overrides
