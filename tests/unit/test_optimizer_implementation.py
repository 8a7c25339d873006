"""Fused Adam/AdamW where the engine allows it (training/optimizers.py): under Accelerate on CUDA
and on CPU (torch 2.4 on), never under DeepSpeed or FSDP2; the same updates as torch's default implementation; and a
checkpoint of another run does not switch it off."""

import pytest
import torch

from vldist.recipes.jobs import load_config
from vldist.training.optimizers import build_optimizers, step_implementation

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_fused_only_under_accelerate(monkeypatch):
    assert step_implementation(CUDA, "accelerate") == {"fused": True}
    assert step_implementation(CPU, "accelerate") == {"fused": True}
    assert step_implementation(CUDA, "deepspeed") == {}  # ZeRO wraps it: DeepSpeed's choice stays
    assert step_implementation(CPU, "deepspeed") == {}
    assert step_implementation(CPU, "fsdp") == {}  # DTensor parameters: torch's default
    assert step_implementation(torch.device("mps"), "accelerate") == {}
    monkeypatch.setattr(torch, "__version__", "2.3.1+cpu")  # no fused CPU kernel before 2.4
    assert step_implementation(CPU, "accelerate") == {}
    assert step_implementation(CUDA, "accelerate") == {"fused": True}


def _optimizers(overrides, device):
    config = load_config("vsrn", overrides)
    return build_optimizers(config, {"main": [torch.nn.Parameter(torch.ones(3))]}, device=device)["main"]


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_job_config_decides_the_implementation(optimizer):
    # built before the engine moves the model: the parameters are still on the CPU here
    fused = _optimizers([f"train.optimizer={optimizer}"], CUDA)
    assert fused.defaults["fused"] is True and fused.param_groups[0]["fused"] is True
    assert not _optimizers([f"train.optimizer={optimizer}", "engine.backend=deepspeed"], CUDA).defaults["fused"]
    assert _optimizers([f"train.optimizer={optimizer}", "train.device=cpu"], None).defaults["fused"]
    assert not _optimizers([f"train.optimizer={optimizer}", "train.device=cpu", "engine.backend=fsdp"], None).defaults[
        "fused"
    ]


def test_a_checkpoint_of_an_unfused_run_keeps_this_runs_fused_steps():
    saved = _optimizers(["train.lr=0.5", "engine.backend=deepspeed"], CPU)  # e.g. written by a DeepSpeed run
    saved.param_groups[0]["params"][0].grad = torch.ones(3)
    saved.step()
    resumed = _optimizers(["train.lr=0.1"], CUDA)
    resumed.load_state_dict(saved.state_dict())
    group, state = resumed.param_groups[0], next(iter(resumed.state.values()))
    assert group["fused"] is True
    assert group["lr"] == 0.5  # the hyperparameters are the checkpoint's, as before
    assert state["step"].dtype == torch.float32 and state["step"].item() == 1  # as fused steps keep it
    group["params"][0].grad = torch.ones(3)
    resumed.step()  # (torch's fused kernel runs on CPU too)
    assert state["step"].item() == 2


DEVICES = [CPU, pytest.param(CUDA, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_steps_equal_the_default_implementation(device, cls):
    """torch's fused kernel exists on CPU too, so the comparison runs everywhere; on CUDA it is the
    one vldist uses. Five steps with weight decay, from the same weights and gradients."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    results = []
    for fused in (None, True):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in start]
        optimizer = cls(params, lr=1e-2, weight_decay=1e-2, fused=fused)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(device)
            optimizer.step()
        results.append([p.detach().cpu() for p in params])
    for default, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, default, rtol=1e-5, atol=1e-6)  # fp32 rounding order only
        assert not torch.equal(default, start[0] if default.dim() == 2 else start[1])  # it did move


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_cpu_runs_checkpoint_resumes_fused():
    saved = _optimizers([], CPU)
    saved.param_groups[0]["params"][0].grad = torch.ones(3)
    saved.step()
    resumed = _optimizers([], CUDA)
    param = resumed.param_groups[0]["params"][0]
    param.data = param.data.cuda()  # as the engine moves the model after the optimizers are built
    resumed.load_state_dict(saved.state_dict())
    param.grad = torch.ones(3, device="cuda")
    resumed.step()
    torch.testing.assert_close(param.detach().cpu(), _after_two_steps())


def _after_two_steps():
    reference = _optimizers([], CPU)
    param = reference.param_groups[0]["params"][0]
    for _ in range(2):
        param.grad = torch.ones(3)
        reference.step()
    return param.detach()
