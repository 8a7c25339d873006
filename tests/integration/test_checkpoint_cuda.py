"""Sharded, asynchronous checkpoints of a model on a CUDA GPU (skipped without one): the background
write saves the state of its step while the next steps change the GPU tensors in place, and a fresh
engine restores it exactly."""

import pytest
import torch

from vldist.checkpoint.manager import Checkpointer
from vldist.data.vocab import Vocab
from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.recipes.jobs import load_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Recipe:
    vocab, feature_dim = Vocab(["red", "circle"]), 64

    @staticmethod
    def build_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))


def _parts(out, *extra):
    config = load_config(
        "vsrn",
        [
            f"output.dir={out}",
            "train.device=cuda",
            "train.checkpoint_format=sharded",
            "train.async_checkpoints=true",
            *extra,
        ],
    )
    engine = AccelerateEngine(config)
    model = Recipe.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine.setup(model, {"main": optimizer})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    state = {"step": 0, "epoch": 0, "epoch_step": 0}
    return Checkpointer(config, engine, {"main": scheduler}, Recipe, lambda: dict(state)), engine, state


def _steps(engine, n):
    for _ in range(n):
        engine.backward(engine.model(torch.randn(32, 64, device=engine.device)).pow(2).mean())
        engine.step("main")


def test_a_background_save_of_cuda_tensors_restores_exactly(tmp_path):
    checkpointer, engine, state = _parts(tmp_path)
    _steps(engine, 3)
    state["step"] = 3
    saved = checkpointer.save_step(3, 0)
    moments = {k: v.clone() for k, v in engine.optimizers["main"].state_dict()["state"][0].items()}
    weights = {k: v.clone() for k, v in engine.unwrap().state_dict().items()}
    _steps(engine, 5)  # in place on the GPU while the files are written
    checkpointer.finish()
    assert (saved / "sharded" / ".metadata").is_file()

    restored, engine2, _ = _parts(tmp_path, f"train.resume={saved}")
    assert restored.load()["step"] == 3
    got = engine2.optimizers["main"].state_dict()["state"][0]
    assert got["exp_avg"].is_cuda and all(torch.equal(got[k].cpu(), moments[k].cpu()) for k in moments)
    assert all(torch.equal(v, weights[k]) for k, v in engine2.unwrap().state_dict().items())
