"""Channels-last CNN trunks (models/memory_format.py) for L2C and LAViTeR: chosen on CUDA, and on
CPU for L2C only (measured faster there), with the same losses and gradients as the default layout
(channels-last runs on CPU too, so the converted path itself is compared here)."""

import copy

import pytest
import torch

from tests.unit.test_laviter_recipe import batch_for, recipe_for  # its tiny LAViTeR
from vldist.models.memory_format import channels_last_wanted
from vldist.recipes.jobs import load_config
from vldist.recipes.l2c import L2CModel

CL = torch.channels_last
# In float64: NCHW and NHWC kernels sum in different orders, and in fp32 batch norm over a few
# images amplifies that rounding to 2e-3 of some of LAViTeR's generator gradients (measured), which
# would hide a real error; in float64 the two layouts agree to ~1e-13 (measured), so a tight bound holds.
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
L2C_TINY = ["model.image_size=64", "model.graph_dim=32", "model.hidden=32", "model.embed=16", "model.classes=3"]


def _job(device: str, backend: str = "accelerate"):
    return load_config("l2c", [f"train.device={device}", f"engine.backend={backend}"])


def test_the_layout_is_chosen_for_cuda_and_on_cpu_where_asked_never_under_deepspeed_or_fsdp():
    assert channels_last_wanted(_job("cuda"))
    assert not channels_last_wanted(_job("cpu"))
    assert channels_last_wanted(_job("auto")) == torch.cuda.is_available()
    assert channels_last_wanted(_job("cpu"), on_cpu=True) and channels_last_wanted(_job("auto"), on_cpu=True)
    # DeepSpeed broadcasts parameters as byte views and FSDP2 refuses non-contiguous ones:
    # both need the default layout
    for backend in ("deepspeed", "fsdp"):
        assert not channels_last_wanted(_job("cuda", backend))
        assert not channels_last_wanted(_job("cpu", backend), on_cpu=True)


def _conv_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]


def _assert_same_training_step(default, converted, step):
    """step(model) -> loss; compares the losses and every parameter's gradient."""
    results = []
    for model in (default, converted):
        torch.manual_seed(0)  # the same dropout masks and noise for both
        model.zero_grad(set_to_none=True)
        loss = step(model)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, **TOLERANCE)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def float64():
    """Models, inputs and the noise the recipes draw, all float64 (see TOLERANCE)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("architecture", ["l2c", "cnn_lstm"])
def test_l2c_channels_last_gives_the_same_step(architecture, float64):
    cfg = load_config("l2c", [*L2C_TINY, f"model.architecture={architecture}"]).model
    default = L2CModel(cfg, vocab_size=20).train()
    converted = copy.deepcopy(default).use_channels_last()
    assert all(w.is_contiguous(memory_format=CL) for w in _conv_weights(converted))
    torch.manual_seed(1)
    images, second = torch.randn(2, 3, 64, 64), torch.randn(2, 3, 64, 64)
    tokens, rows = torch.randint(1, 20, (3, 8)), torch.tensor([0, 1, 1])
    seen = []
    cnn = converted.encoder.trunk if architecture == "l2c" else converted.trunk
    cnn.register_forward_hook(lambda m, i, out: seen.append(out.is_contiguous(memory_format=CL)))

    def step(model):
        logits, aux = model(images, second, tokens, rows)
        extra = [aux[k].sum() for k in ("mask_logits", "confidence") if aux.get(k) is not None]
        return logits.float().pow(2).mean() + sum(extra)

    _assert_same_training_step(default, converted, step)
    assert seen == [True]  # the trunk really ran NHWC (its input was converted by the hook)


def test_laviter_channels_last_gives_the_same_discriminator_and_main_steps(float64):
    recipe = recipe_for("joint")
    default = recipe.build_model().train()
    assert not any(w.is_contiguous(memory_format=CL) and w.shape[-1] > 1 for w in _conv_weights(default))  # CPU job
    converted = copy.deepcopy(default).use_channels_last()
    batch = batch_for(recipe)
    for update in recipe.updates(0):
        _assert_same_training_step(
            default, converted, lambda model, u=update: recipe.training_losses(model, batch, u)["loss"]
        )


def test_a_cpu_l2c_job_builds_its_cnn_channels_last_and_laviter_does_not(tmp_path):
    from vldist.recipes.l2c import L2CRecipe

    for architecture in ("l2c", "cnn_lstm"):
        config = load_config("l2c", [*L2C_TINY, f"model.architecture={architecture}", "train.device=cpu"])
        model = L2CRecipe(config, ["<pad>", "<start>", "<end>", "a", "b"], 0).build_model()
        weights = _conv_weights(model)
        assert weights and all(w.is_contiguous(memory_format=CL) for w in weights if w.shape[-1] > 1), architecture
    laviter = _conv_weights(recipe_for("joint", "train.device=cpu").build_model())
    assert not any(w.is_contiguous(memory_format=CL) and w.shape[-1] > 1 for w in laviter)


def test_a_cuda_job_builds_its_trunks_channels_last():
    recipe = recipe_for("joint", "train.device=cuda")  # building needs no GPU
    weights = _conv_weights(recipe.build_model())
    assert weights and all(w.is_contiguous(memory_format=CL) for w in weights)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sharding_engines_get_contiguous_parameters(backend, device):
    """FSDP2's fully_shard refuses a non-contiguous parameter ("FSDP does not support non-contiguous
    parameters yet") and DeepSpeed's start views each as bytes: an L2C or LAViTeR job under either
    builds every parameter in torch's default layout, on CPU and on CUDA alike."""
    from vldist.recipes.l2c import L2CRecipe

    config = load_config("l2c", [*L2C_TINY, f"train.device={device}", f"engine.backend={backend}"])
    models = [
        L2CRecipe(config, ["<pad>", "<start>", "<end>", "a", "b"], 0).build_model(),
        recipe_for("joint", f"train.device={device}", f"engine.backend={backend}").build_model(),
    ]
    for model in models:
        assert all(p.is_contiguous() for p in model.parameters()), type(model).__name__
