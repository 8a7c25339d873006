"""train.activation_checkpointing: every built-in recipe's step, with its named blocks checkpointed,
takes the losses, every parameter's gradient and every buffer (BatchNorm's running statistics
moved once) of the same step without, dropout active; the blocks really run again in the
backward; names and state_dict keys stay; evaluation forwards are plain; ZeRO-3, a recipe
without blocks and LAViTeR under torch.compile are refused by name."""

import copy

import pytest
import torch
from helpers import bench_module
from torch import nn

from vldist.errors import ConfigError
from vldist.training.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_blocks,
    is_checkpointed,
)

TINY_CAPTIONER = ["model.hidden=16", "model.embed=8", "data.max_regions=3"]
# recipe -> (shard fixture, overrides, blocks expected): small models, dropout left on
CASES = {
    "vsrn": (
        "planted_shards",
        ["model.embed_size=16", "model.decoder_hidden=16", "model.word_dim=8", "model.rrr_layers=2"],
        ["image.rrr.0", "image.rrr.1", "decoder"],
    ),
    "captioner": ("planted_shards", TINY_CAPTIONER, ["decoder"]),
    "cl_caption": ("planted_shards", [*TINY_CAPTIONER, "model.init_from=unused"], ["target.decoder"]),
    "two_branch_embed": ("planted_shards", ["model.hidden=16", "model.embed=8", "model.tasks=[retrieval]"], None),
    "two_branch_sim": ("planted_shards", ["model.hidden=16", "model.embed=8", "model.tasks=[retrieval]"], None),
    "l2c": (
        "pair_shards",
        ["model.image_size=64", "model.graph_dim=16", "model.hidden=16", "model.embed=8", "model.classes=3"],
        ["encoder.trunk", "encoder.gcn.0", "encoder.gcn.1", "decoder"],
    ),
    "laviter": (
        "scene_splits",
        [
            "model.phase=joint",
            "model.embed_dim=16",
            "model.text_heads=2",
            "model.gf_dim=2",
            "model.df_dim=2",
            "model.itm_dim=16",
            "model.itm_heads=2",
            "model.itm_encoder_layers=1",
            "model.itm_decoder_layers=1",
            "model.itm_feedforward=16",
            "model.z_dim=4",
            "model.condition_dim=4",
            "model.residual_blocks=1",
            "data.max_caption_len=12",
            "model.max_words=8",
        ],
        None,
    ),
}
recipe_and_batch = bench_module("activation_checkpointing").recipe_and_batch  # the bench's batches, 4 rows


def step(recipe, model, batch) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Each update's losses (seeded: the same dropout masks and draws with and without) and the
    gradients they leave, accumulated over the step's updates."""
    recipe.start_step(0)
    losses = []
    for update in recipe.updates(0):
        torch.manual_seed(1)
        out = recipe.training_losses(model, batch, update)
        out["loss"].backward()
        losses.append({k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)})
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


class BlockCalls:
    """How many times the checkpointed blocks' submodules were called."""

    def __init__(self, blocks):
        self.count = 0
        for block in blocks:
            for module in block.modules():
                module.register_forward_pre_hook(self._called)

    def _called(self, *_):
        self.count += 1


# Exactly the plain step, except VSRN's: its plain step runs the written-out decoder loop
# (models/attention_gru_loop.py), the checkpointed one the autograd loop that it recomputes step by
# step, equal to fp32 rounding (tests/unit/test_attention_gru_loop.py checks the two in float64).
EXACT = dict(rtol=0, atol=0)
TOLERANCE = {"vsrn": dict(rtol=1e-5, atol=1e-6)}


@pytest.mark.parametrize("name", list(CASES))
def test_the_checkpointed_step_is_the_plain_step_and_recomputes_its_blocks(name, request):
    fixture, overrides, expected_blocks = CASES[name]
    recipe, batch = recipe_and_batch(name, request.getfixturevalue(fixture), overrides)
    torch.manual_seed(0)
    plain = recipe.build_model().train()
    checkpointed = copy.deepcopy(plain)
    blocks = recipe.checkpointed_blocks(checkpointed)
    names = checkpoint_blocks(checkpointed, blocks)
    assert blocks and all(is_checkpointed(b) for b in blocks)
    if expected_blocks is not None:
        assert names == expected_blocks
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    calls = BlockCalls(blocks)

    plain_losses, plain_grads = step(recipe, plain, batch)
    losses = []
    recipe.start_step(0)
    for update in recipe.updates(0):
        torch.manual_seed(1)
        out = recipe.training_losses(checkpointed, batch, update)
        forward_calls = calls.count
        out["loss"].backward()
        assert calls.count > forward_calls, f"{name} {update}: no block ran again in the backward"
        losses.append({k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)})
    grads = {n: p.grad for n, p in checkpointed.named_parameters() if p.grad is not None}

    for got, expected in zip(losses, plain_losses, strict=True):
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], **TOLERANCE.get(name, EXACT), msg=f"{name} {key}")
    assert grads.keys() == plain_grads.keys() and plain_grads
    for key, grad in plain_grads.items():
        torch.testing.assert_close(grads[key], grad, **TOLERANCE.get(name, EXACT), msg=f"{name} gradient of {key}")
    plain_state = plain.state_dict()  # BatchNorm's running statistics: moved once, as without
    for key, value in checkpointed.state_dict().items():
        assert torch.equal(value, plain_state[key]), f"{name} {key}"


@pytest.mark.parametrize("name", ["vsrn", "two_branch_sim"])
def test_evaluation_and_no_grad_forwards_run_plainly(name, request):
    fixture, overrides, _ = CASES[name]
    recipe, batch = recipe_and_batch(name, request.getfixturevalue(fixture), overrides)
    torch.manual_seed(0)
    model = recipe.build_model()
    blocks = recipe.checkpointed_blocks(model)
    plain = copy.deepcopy(model).eval()
    checkpoint_blocks(model, blocks)
    calls = BlockCalls(blocks)
    model.eval()
    update = recipe.updates(0)[-1]
    torch.manual_seed(1)
    out = recipe.training_losses(model, batch, update)
    before = calls.count
    out["loss"].backward()
    assert calls.count == before  # nothing recomputed: the eval forward kept its activations
    torch.manual_seed(1)
    torch.testing.assert_close(out["loss"], recipe.training_losses(plain, batch, update)["loss"], rtol=0, atol=0)
    model.train()
    with torch.no_grad():
        recipe.training_losses(model, batch, update)  # no checkpoint under no_grad (it would warn and keep nothing)


def test_zero3_and_a_recipe_without_blocks_are_refused_by_name(planted_shards, request):
    recipe, _ = recipe_and_batch("vsrn", planted_shards, CASES["vsrn"][1])
    model = recipe.build_model()

    class Zero3:
        stage = 3

    with pytest.raises(ConfigError, match="train.activation_checkpointing under DeepSpeed ZeRO-3"):
        apply_activation_checkpointing(model, recipe, Zero3())
    laviter, _ = recipe_and_batch(
        "laviter", request.getfixturevalue("scene_splits"), [*CASES["laviter"][1], "train.compile=model"]
    )
    with pytest.raises(
        ConfigError, match="train.activation_checkpointing with train.compile=model: recipe 'laviter' refuses"
    ):
        apply_activation_checkpointing(laviter.build_model(), laviter, object())
    recipe.checkpointed_blocks = lambda model: []
    with pytest.raises(ConfigError, match="recipe 'vsrn' names no blocks to checkpoint"):
        apply_activation_checkpointing(model, recipe, object())
    with pytest.raises(ValueError, match="not a submodule of the model"):
        checkpoint_blocks(model, [nn.Linear(2, 2)])


class MaskedNorm(nn.Module):
    """Batch norm over the rows a mask keeps (VSRN's RRR residual): its data-dependent shape is a
    graph break that dynamo cannot trace inside a checkpoint, so the compiled frame runs it eagerly."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear, self.norm = nn.Linear(dim, dim), nn.BatchNorm1d(dim)

    def forward(self, x, mask):
        out = torch.zeros_like(x)
        out[mask] = self.norm(self.linear(x)[mask])
        return x + out


class TwoBlocks(nn.Module):
    def __init__(self, dim: int = 6):
        super().__init__()
        self.traced = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.Dropout(0.5), nn.Tanh())
        self.masked = MaskedNorm(dim)

    def forward(self, x, mask):
        return self.masked(self.traced(x), mask).pow(2).sum()


def test_under_torch_compile_the_step_and_the_statistics_are_the_plain_ones():
    """A block dynamo traces whole (recomputed inside the compiled backward) and one it runs
    eagerly (a graph break in its body): both give the plain step's gradients, and batch norms
    move their running statistics once. (Every recipe under train.compile=model and =step:
    docs/performance.md.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = TwoBlocks().train()
    compiled = copy.deepcopy(plain)
    checkpoint_blocks(compiled, [compiled.traced, compiled.masked])
    calls = BlockCalls([compiled.masked])
    compiled.compile(backend="aot_eager")
    x, mask = torch.randn(8, 6), torch.tensor([True] * 6 + [False] * 2)
    for model in (plain, compiled):
        torch.manual_seed(1)
        loss = model(x, mask)
        before = calls.count
        loss.backward()
    assert calls.count > before  # the eager block ran again in the backward
    for (key, p), q in zip(plain.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=key)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    torch._dynamo.reset()
