import os

import pytest
import torch

from vldist.checkpoint.format import (
    find_checkpoint,
    load_model_state,
    load_train_state,
    prune,
    save_checkpoint,
    step_checkpoints,
)
from vldist.data.vocab import Vocab
from vldist.errors import CheckpointError


def _save(directory, value=1.0):
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_checkpoint(
        directory,
        model_state=model.state_dict(),
        train_state={"optimizer": opt.state_dict(), "step": 7},
        config_yaml="recipe: vsrn\n",
        vocab=Vocab(["a"]),
        meta={"epoch": 1},
    )
    return model, opt


def test_round_trip_with_safe_loading(tmp_path):
    model, opt = _save(tmp_path / "ckpt")
    state = load_model_state(tmp_path / "ckpt")
    assert torch.equal(state["weight"], model.weight.detach())
    train = load_train_state(tmp_path / "ckpt")  # torch.load(weights_only=True) inside
    assert train["step"] == 7
    assert torch.equal(train["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_replacing_a_checkpoint_leaves_no_temporaries(tmp_path):
    _save(tmp_path / "best", 1.0)
    second, _ = _save(tmp_path / "best", 2.0)
    assert torch.equal(load_model_state(tmp_path / "best")["weight"], second.weight.detach())
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_incomplete_checkpoint_is_refused(tmp_path):
    _save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_model_state(tmp_path / "ckpt")


def test_truncated_weights_give_a_clear_error(tmp_path):
    _save(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="damaged"):
        load_model_state(tmp_path / "ckpt")
    state = tmp_path / "ckpt" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged"):
        load_train_state(tmp_path / "ckpt")


def test_find_checkpoint_prefers_best_then_the_newest_step(tmp_path):
    run = tmp_path / "run"
    _save(run / "checkpoints" / "step-00000010")
    _save(run / "checkpoints" / "step-00000100")
    _save(run / "checkpoints" / "step-00000020")
    assert find_checkpoint(run) == run / "checkpoints" / "step-00000100"  # by step, not by name or time
    _save(run / "checkpoints" / "best")
    assert find_checkpoint(run) == run / "checkpoints" / "best"
    (run / "checkpoints" / "best" / "COMPLETE").unlink()
    assert find_checkpoint(run) == run / "checkpoints" / "step-00000100"
    with pytest.raises(CheckpointError):
        find_checkpoint(tmp_path / "nothing")


def test_the_directory_of_a_job_of_several_stages_names_its_stage_runs(tmp_path):
    job = tmp_path / "two_branch_embed"
    _save(job / "retrieval" / "checkpoints" / "step-00000010")
    _save(job / "phrases" / "checkpoints" / "step-00000010")
    with pytest.raises(CheckpointError, match="several stages") as err:
        find_checkpoint(job)
    assert str(job / "phrases") in str(err.value) and str(job / "retrieval") in str(err.value)
    assert find_checkpoint(job / "phrases") == job / "phrases" / "checkpoints" / "step-00000010"


def test_prune_keeps_the_newest_complete_steps(tmp_path):
    for step in (5, 10, 15, 20):
        _save(tmp_path / f"step-{step:08d}")
    (tmp_path / "step-00000020" / "COMPLETE").unlink()  # a save cut short: not counted, not kept
    prune(tmp_path, keep_last=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000010", "step-00000015"]


def test_verify_finds_a_changed_or_truncated_file_in_any_subdirectory(tmp_path):
    from vldist.checkpoint.format import begin, commit, verify, write_files

    directory = tmp_path / "step-00000003"
    tmp = begin(directory)
    write_files(
        tmp,
        model_state={"w": torch.ones(3)},
        train_state={"step": 3},
        config_yaml="recipe: vsrn\n",
        vocab=Vocab(["a"]),
        meta={},
    )
    (tmp / "deepspeed").mkdir()
    (tmp / "deepspeed" / "rank_1.pt").write_bytes(b"x" * 100)  # what another rank wrote
    commit(tmp, directory)
    verify(directory)  # intact
    shard = directory / "deepspeed" / "rank_1.pt"
    shard.write_bytes(b"y" + b"x" * 99)  # same size, other content
    with pytest.raises(CheckpointError, match="rank_1.pt.*damaged"):
        verify(directory)
    shard.write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="10 bytes, not the 100 written"):
        verify(directory)
