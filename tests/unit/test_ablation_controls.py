"""The ablation benches' control rows (issue 45) take what they say: L2C's pairs-equal-steps the
full row's optimizer steps, learning rate at every step and validation steps; LAViTeR's
vta-frozen-matched vta-trainable's phases, epochs and rates, with E_I's whole trunk frozen in
phase 3. The rows' overrides come from the benches themselves, the runs' numbers from vldist's own
stream, schedule and phase code."""

import pytest
import torch
from helpers import bench_module

from vldist.data.job_shards import JobShards
from vldist.data.shardset import ShardSet
from vldist.data.streams import TrainingStreams
from vldist.data.vocab import Vocab
from vldist.recipes.jobs import load_config
from vldist.recipes.l2c import L2CRecipe
from vldist.recipes.laviter import LAViTeRRecipe
from vldist.training.optimizers import build_scheduler

# ---------------------------------------------------------------- L2C: equal optimizer steps


def _l2c_run(pair_shards, scene_images, key: str, epochs: int | None):
    """The bench's argv for row `key` (its overrides, then the common --epochs ones), as a config
    and its training streams on the miniature sets: 64 pairs of 16 a step, 64 single images of 32."""
    bench = bench_module("l2c_ablation")
    row = next(r for r in bench.ROWS if r.key == key)
    overrides, common = list(row.overrides), [f"train.epochs={epochs}"] if epochs else []
    if key == bench.EQUAL_STEPS:
        overrides += bench.equal_steps(epochs)
        common = []
    config = load_config(
        "l2c",
        [
            f"data.shards={pair_shards}",
            f"model.single_shards={scene_images}",
            "data.workers=0",
            "model.image_size=64",
            *overrides,
            *common,
        ],
    )
    shards = ShardSet.open(pair_shards)
    recipe = L2CRecipe(config, shards.vocab(pair_shards), shards.feature_dim())
    return config, TrainingStreams(config, recipe, JobShards(shards), 0, 1)


def _lr_factors(config, streams) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    factor = build_scheduler(config, optimizer, streams.steps_per_epoch, streams.total_steps).lr_lambdas[0]
    return [factor(step) for step in range(streams.total_steps)]


def _validation_steps(config, streams) -> set[int]:
    """The steps after which the run validates: the end of each epoch validate_every names, and the last."""
    every, per_epoch = config.train.validate_every, streams.steps_per_epoch
    ends = {(e + 1) * per_epoch for e in range(streams.epochs) if (e + 1) % every == 0}
    return {min(s, streams.total_steps) for s in ends} | {streams.total_steps}


@pytest.mark.parametrize("epochs", [2, None])  # the committed bench's --epochs 2, and the job's 4
def test_l2c_equal_steps_control_takes_the_full_rows_steps_rates_and_validations(pair_shards, scene_images, epochs):
    full_config, full = _l2c_run(pair_shards, scene_images, "full", epochs)
    pairs_config, pairs = _l2c_run(pair_shards, scene_images, "pairs-only", epochs)
    control_config, control = _l2c_run(pair_shards, scene_images, "pairs-equal-steps", epochs)
    # the confound: one single-image step per pair step doubles the full row's steps
    assert list(full.counts) == ["pairs", "single"] and full.counts["single"] == full.counts["pairs"] == 4
    assert full.total_steps == 2 * pairs.total_steps
    # the control: pairs alone, the full row's steps
    assert list(control.counts) == ["pairs"] and control.counts["pairs"] == pairs.counts["pairs"]
    assert control.total_steps == full.total_steps
    assert _lr_factors(control_config, control) == _lr_factors(full_config, full)
    assert _validation_steps(control_config, control) == _validation_steps(full_config, full)
    if epochs is None:  # the job's 4 epochs decay the rate after 3: both at the same step
        assert 0.1 in _lr_factors(full_config, full)
    assert control_config.model.single_images is False and pairs_config.model.single_images is False


# ---------------------------------------------------------------- LAViTeR: frozen against trainable

TINY = ["model.embed_dim=32", "model.text_heads=2", "model.max_words=8", "data.max_caption_len=12"]


def _laviter_stages(key: str) -> list:
    bench = bench_module("laviter_ablation")
    row = next(r for r in bench.ROWS if r.key == key)
    epochs, last = bench.phase_epochs(key, 2, 1)  # the bench's default --vta-epochs 2 --joint-epochs 1
    config = load_config("laviter", [*TINY, *row.overrides, *epochs, "model.assist_epochs=1"])
    stages = LAViTeRRecipe.stages(config)
    assert stages[-1][0] == last
    return stages


def _without(dump: dict, *paths: tuple[str, str]) -> dict:
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in dump.items()}
    for section, key in paths:
        out[section].pop(key)
    return out


def test_laviter_frozen_control_differs_from_the_trainable_row_in_phase_3s_frozen_blocks_only():
    trainable, frozen = _laviter_stages("vta-trainable"), _laviter_stages("vta-frozen-matched")
    assert [p for p, _ in trainable] == [p for p, _ in frozen] == ["pretrain", "vta", "joint"]
    for (phase, a), (_, b) in zip(trainable, frozen, strict=True):
        assert (a.train.epochs, a.train.lr) == (b.train.epochs, b.train.lr), phase
        da, db = a.model_dump(), b.model_dump()
        assert da["model"]["frozen_blocks"] == 5 and db["model"]["frozen_blocks"] == 7
        # everything else the same (both configs keep the job's output.dir here; the bench gives each row its own)
        assert _without(da, ("model", "frozen_blocks")) == _without(db, ("model", "frozen_blocks")), phase
    # the old frozen row: its third DAMSM epoch in phase 1 at the phase-1 rate, not in phase 3
    old = _laviter_stages("vta-frozen")
    assert [(p, c.train.epochs, c.train.lr) for p, c in old][1:] == [("vta", 3, old[1][1].model.vta_lr)]
    assert trainable[2][1].train.lr == trainable[2][1].model.joint_lr != trainable[1][1].model.vta_lr


def _trains(config) -> tuple[dict[str, bool], dict[str, bool]]:
    """Which parameters train in the config's phase: E_I's trunk blocks', then all the others'."""
    vocab = Vocab.build(["a small red circle left of a blue square", "a large green star"])
    trains = {name: p.requires_grad for name, p in LAViTeRRecipe(config, vocab).build_model().named_parameters()}
    blocks = {name: on for name, on in trains.items() if name.startswith("image_encoder.blocks.")}
    return blocks, {name: on for name, on in trains.items() if name not in blocks}


def test_in_phase_3_the_frozen_control_trains_no_trunk_block_and_the_rest_as_the_trainable_row():
    (_, trainable), (_, frozen) = _laviter_stages("vta-trainable")[-1], _laviter_stages("vta-frozen-matched")[-1]
    blocks_t, rest_t = _trains(trainable)
    blocks_f, rest_f = _trains(frozen)
    assert not any(blocks_f.values())  # all 7 blocks of the small trunk
    trained = {name.split(".")[2] for name, on in blocks_t.items() if on}
    assert trained == {"5", "6"} and len({name.split(".")[2] for name in blocks_t}) == 7
    assert rest_f == rest_t and any(rest_f.values())
    # and the trunk as in phase 1, where both rows keep it frozen
    (_, vta_t), (_, vta_f) = _laviter_stages("vta-trainable")[1], _laviter_stages("vta-frozen-matched")[1]
    assert not any(_trains(vta_t)[0].values()) and not any(_trains(vta_f)[0].values())
