"""The Checkpointer: a step checkpoint restores the weights, the optimizer's moments, the LR
schedule, the RNG and the run's own state exactly; a damaged newest checkpoint falls back to the
one before; a failed write leaves nothing behind and says so."""

import pytest
import torch

from vldist.checkpoint.manager import Checkpointer, rank_rng_state
from vldist.checkpoint.resharding import refuse_unconvertible
from vldist.data.vocab import Vocab
from vldist.errors import CheckpointError, CheckpointWriteError, IncompatibleCheckpoint
from vldist.recipes.jobs import load_config

VOCAB = Vocab(["red", "circle"])


class TinyRecipe:
    """What a Checkpointer reads of a recipe: its vocabulary, feature width and model."""

    vocab, feature_dim = VOCAB, 3

    @staticmethod
    def build_model():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 2)


def parts(tmp_path, resume=None, *extra):
    """(checkpointer, engine, scheduler, run state) over a tiny model on the CPU engine."""
    from vldist.distributed.accelerate_engine import AccelerateEngine

    overrides = [
        f"output.dir={tmp_path}",
        "train.device=cpu",
        "model.embed_size=4",
        "model.word_dim=4",
        "model.decoder_hidden=4",
        *([f"train.resume={resume}"] if resume else []),
        *extra,
    ]
    config = load_config("vsrn", overrides)
    engine = AccelerateEngine(config)
    model = TinyRecipe.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    engine.setup(model, {"main": optimizer})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = {"step": 0, "epoch": 0, "epoch_step": 0}
    checkpointer = Checkpointer(config, engine, {"main": scheduler}, TinyRecipe, lambda: dict(state))
    return checkpointer, engine, scheduler, state


def train_steps(engine, scheduler, state, n):
    for _ in range(n):
        loss = engine.model(torch.randn(4, 3)).pow(2).sum()
        engine.backward(loss)
        engine.step("main")
        scheduler.step()
        state["step"] += 1
        state["epoch_step"] += 1


def test_a_step_checkpoint_restores_everything_the_run_needs(tmp_path):
    checkpointer, engine, scheduler, state = parts(tmp_path)
    train_steps(engine, scheduler, state, 3)
    path = checkpointer.save_step(state["step"], state["epoch"])
    assert path.name == "step-00000003" and checkpointer.saved_step == 3 and checkpointer.saved() == [path]
    saved_weights = {k: v.clone() for k, v in engine.unwrap().state_dict().items()}
    saved_moments = engine.optimizers["main"].state_dict()["state"][0]["exp_avg"].clone()
    draws_after_save = torch.rand(5)

    restored_checkpointer, engine2, scheduler2, _ = parts(tmp_path, resume="latest")
    torch.manual_seed(123)  # the RNG must come back from the checkpoint, not from here
    run = restored_checkpointer.load()
    assert run == {"step": 3, "epoch": 0, "epoch_step": 3}
    for name, value in engine2.unwrap().state_dict().items():
        assert torch.equal(value, saved_weights[name]), name
    assert torch.equal(engine2.optimizers["main"].state_dict()["state"][0]["exp_avg"], saved_moments)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr() == [0.05]
    assert torch.equal(torch.rand(5), draws_after_save)


def test_a_damaged_newest_checkpoint_falls_back_and_none_usable_is_an_error(tmp_path):
    checkpointer, engine, scheduler, state = parts(tmp_path)
    train_steps(engine, scheduler, state, 1)
    checkpointer.save_step(1, 0)
    train_steps(engine, scheduler, state, 1)
    newest = checkpointer.save_step(2, 0)
    (newest / "model.safetensors").write_bytes(b"broken")
    assert parts(tmp_path, resume="latest")[0].load()["step"] == 1
    for path in checkpointer.saved():
        (path / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        parts(tmp_path, resume="latest")[0].load()


def test_auto_starts_fresh_without_a_checkpoint(tmp_path):
    assert parts(tmp_path, resume="auto")[0].load() is None
    assert parts(tmp_path)[0].load() is None  # train.resume unset


def test_a_failed_write_leaves_nothing_and_says_where(tmp_path, monkeypatch):
    checkpointer, engine, scheduler, state = parts(tmp_path)

    def full_disk(directory):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "save_training_state", full_disk)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        checkpointer.save_step(1, 0)
    assert checkpointer.saved() == [] and not list(checkpointer.directory.glob("*tmp*"))


def test_a_checkpoint_of_another_engine_is_refused_by_name_and_no_older_one_is_tried(tmp_path, caplog):
    checkpointer, engine, scheduler, state = parts(tmp_path)
    for step in (1, 2):
        train_steps(engine, scheduler, state, 1)
        checkpointer.save_step(step, 0)
    # The engine that reads is the CPU one; the job says DeepSpeed, as a user switching engines would.
    resuming = parts(tmp_path, "latest", "engine.backend=deepspeed")[0]
    with pytest.raises(IncompatibleCheckpoint) as refused:
        resuming.load()
    message = str(refused.value)
    assert (
        "step-00000002" in message and "engine.backend=accelerate" in message and "engine.backend=deepspeed" in message
    )
    assert "damaged" not in message and "earlier checkpoint" not in caplog.text


def test_zero3_state_and_zero_1_or_2_state_are_refused_as_unconvertible(tmp_path):
    for saved, now in [(1, 2), (2, 1), (3, 3), (0, 0)]:
        refuse_unconvertible(tmp_path, saved, now)  # DeepSpeed converts these
    for saved, now in [(2, 3), (3, 1), (0, 2), (1, 0)]:
        with pytest.raises(IncompatibleCheckpoint, match=f"stage {saved} state, and this job runs stage {now}"):
            refuse_unconvertible(tmp_path, saved, now)


def test_the_rng_rule_on_another_world_size():
    saved = [torch.Generator().manual_seed(r).get_state() for r in range(2)]
    # The same world size: each rank its own saved state, bit for bit.
    assert all(torch.equal(rank_rng_state(saved, r, 2, seed=7, step=10), saved[r]) for r in range(2))

    def first_draw(state):
        return float(torch.rand((), generator=torch.Generator().set_state(state)))

    # Another: a fresh stream per rank, none of them a saved one, the same on every resume.
    on_three = [first_draw(rank_rng_state(saved, r, 3, seed=7, step=10)) for r in range(3)]
    assert len(set(on_three) | {first_draw(s) for s in saved}) == 5
    assert on_three == [first_draw(rank_rng_state(saved, r, 3, seed=7, step=10)) for r in range(3)]
    assert first_draw(rank_rng_state(saved, 0, 1, seed=7, step=10)) == on_three[0]
    assert first_draw(rank_rng_state(saved, 0, 1, seed=7, step=11)) != on_three[0]  # another checkpoint, another stream


def test_sharded_asynchronous_checkpoints_restore_everything_and_hold_weights_only_when_final(tmp_path):
    fmt = ("train.checkpoint_format=sharded", "train.async_checkpoints=true")
    checkpointer, engine, scheduler, state = parts(tmp_path, None, *fmt)
    train_steps(engine, scheduler, state, 2)
    periodic = checkpointer.save_step(2, 0)
    saved_moments = engine.optimizers["main"].state_dict()["state"][0]["exp_avg"].clone()
    saved_weights = {k: v.clone() for k, v in engine.unwrap().state_dict().items()}
    train_steps(engine, scheduler, state, 1)  # while the files are written
    final = checkpointer.save_step(3, 0, final=True)
    checkpointer.finish()
    assert checkpointer.saved() == [periodic, final] and checkpointer.saved_step == 3
    assert not (periodic / "model.safetensors").exists() and (final / "model.safetensors").is_file()

    restored, engine2, scheduler2, _ = parts(tmp_path, str(periodic), *fmt)
    assert restored.load()["step"] == 2
    assert torch.equal(engine2.optimizers["main"].state_dict()["state"][0]["exp_avg"], saved_moments)
    assert all(torch.equal(v, saved_weights[k]) for k, v in engine2.unwrap().state_dict().items())


def test_a_failed_background_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    import threading

    from vldist.checkpoint import manager as module

    fmt = ("train.checkpoint_format=sharded", "train.async_checkpoints=true")
    checkpointer, engine, scheduler, state = parts(tmp_path, None, *fmt)
    train_steps(engine, scheduler, state, 1)
    first = checkpointer.save_step(1, 0, wait=True)
    release, write_files = threading.Event(), module.write_files

    def disk_fills_up(tmp, **contents):
        release.wait(30)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_files", disk_fills_up)
    train_steps(engine, scheduler, state, 1)
    checkpointer.save_step(2, 0)  # returns at once; the write is still in flight
    # Meanwhile (a crash now would leave this): the in-flight save is no checkpoint, the first is.
    assert checkpointer.saved() == [first]
    assert parts(tmp_path, "latest", *fmt)[0].load()["step"] == 1
    release.set()
    with pytest.raises(CheckpointWriteError, match=f"No space left on device.*{first.name} is complete and usable"):
        checkpointer.finish()
    assert checkpointer.saved() == [first] and not list(checkpointer.directory.glob(".*tmp"))
    monkeypatch.setattr(module, "write_files", write_files)


def test_sharded_or_asynchronous_checkpoints_are_refused_under_deepspeed():
    from vldist.distributed.deepspeed_engine import DeepSpeedEngine
    from vldist.errors import ConfigError

    for option in ("train.checkpoint_format=sharded", "train.async_checkpoints=true"):
        with pytest.raises(ConfigError, match="the Accelerate engine's"):
            DeepSpeedEngine(load_config("vsrn", ["engine.backend=deepspeed", "train.device=cpu", option]))


def test_the_sharded_state_keeps_the_loss_scalers_state_beside(tmp_path):
    """fp16 on CUDA keeps a GradScaler; its state (plain numbers) travels in the DCP files beside
    the model and optimizer and comes back through the weights-only loader."""
    from vldist.checkpoint import sharded_state

    model = TinyRecipe.build_model()
    optimizer = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    saved = {"scaler": scaler.state_dict()}
    sharded_state.save(model, {"main": optimizer}, tmp_path / "sharded", extra=saved)
    template = {"scaler": torch.amp.GradScaler("cpu", init_scale=2.0).state_dict()}
    loaded = sharded_state.load(model, {"main": optimizer}, tmp_path / "sharded", extra=template)
    assert loaded["scaler"] == saved["scaler"] and loaded["scaler"]["scale"] == 1024.0
