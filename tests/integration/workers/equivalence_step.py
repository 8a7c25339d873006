"""One VSRN training step on this rank's slice of a fixed global batch; rank 0 saves the outcome.

Run by tests/integration/test_distributed_equivalence.py under torchrun (2 gloo processes) and
in-process (1 process): the two must agree.
"""

import random
import sys

import numpy as np
import torch
from engines import cpu_engine

from vldist.data.vocab import Vocab
from vldist.distributed.collectives import global_sum
from vldist.distributed.engine import Engine
from vldist.models.global_batchnorm import convert_global_batchnorm
from vldist.recipes.jobs import load_config
from vldist.recipes.vsrn import VSRNRecipe

GLOBAL_BATCH = 8
VOCAB = Vocab(["a", "red", "blue", "green", "circle", "square", "star", "left", "of", "above"])


def make_recipe(gather: bool, *overrides: str) -> VSRNRecipe:
    config = load_config(
        "vsrn",
        [
            "model.embed_size=16",
            "model.word_dim=8",
            "model.decoder_hidden=16",
            "model.decoder_dropout=0",
            "model.max_violation_warmup_epochs=0",
            f"model.gather_negatives={str(gather).lower()}",
            "data.max_regions=5",
            f"data.batch_size={GLOBAL_BATCH}",
            "train.grad_clip=null",
            *overrides,
        ],
    )
    return VSRNRecipe(config, VOCAB, feature_dim=12)


def global_samples() -> list[dict]:
    """Ragged on purpose: 2-5 regions per image and captions of different lengths."""
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    samples = []
    for i in range(GLOBAL_BATCH):
        regions = rng.standard_normal((2 + i % 4, 12)).astype(np.float32)
        caption = " ".join(rng.choice(words, size=3 + (i * 3) % 5))
        samples.append({"regions": regions, "tokens": VOCAB.encode(caption)})
    return samples


def build_model(recipe: VSRNRecipe) -> torch.nn.Module:
    torch.manual_seed(0)
    model = recipe.build_model()
    for module in model.modules():  # BN starts at 0 (identity RRR); make the GCN branch matter
        if isinstance(module, torch.nn.BatchNorm1d):
            torch.nn.init.constant_(module.weight, 0.5)
    return model


def my_rows(engine: Engine, ragged: bool, micro_batches: int) -> list[list[dict]]:
    """This rank's rows of each micro-batch. Global micro-batch k is rows [k*m, (k+1)*m) of the
    global batch (m = GLOBAL_BATCH / micro_batches), split evenly over the ranks; ragged: rank 0
    takes 3 rows and rank 1 takes 5, as in the last batch of an exact epoch."""
    samples, m, world = global_samples(), GLOBAL_BATCH // micro_batches, engine.world_size
    if ragged and world == 2:
        return [samples[[0, 3][engine.rank] : [3, 8][engine.rank]]]
    return [
        samples[k * m + engine.rank * m // world : k * m + (engine.rank + 1) * m // world] for k in range(micro_batches)
    ]


def step(engine: Engine, recipe: VSRNRecipe, ragged: bool = False, micro_batches: int = 1) -> dict:
    recipe.uniform_shapes = engine.uniform_shapes
    module = build_model(recipe)
    if engine.world_size > 1:
        convert_global_batchnorm(module)
    model = engine.setup(module, {"main": torch.optim.SGD(module.parameters(), lr=0.5)})
    totals = {"loss": 0.0, "matching": 0.0, "caption": 0.0}
    rows = my_rows(engine, ragged, micro_batches)
    for k, mine in enumerate(rows):
        with engine.micro_batch(last=k == len(rows) - 1):
            losses = recipe.training_losses(model, recipe.collate_train(mine))
            engine.backward(losses["loss"], len(rows))
        for key in totals:
            totals[key] += float(global_sum(losses[key])) / len(rows)
    return outcome(engine, totals)


def outcome(engine: Engine, totals: dict) -> dict:
    """The step's logged `totals`, its gradients, then the SGD update taken: what rank 0 saves."""
    # Under ZeRO-2/3 gradients live in DeepSpeed's partitions, not in .grad
    grads = {n: p.grad.clone() for n, p in engine.unwrap().named_parameters() if p.grad is not None}
    engine.step("main", None)
    state = engine.model_state_dict()
    return {
        **totals,
        "grads": grads,
        "params": state and {n: state[n] for n, _ in engine.unwrap().named_parameters()},
        "world_size": engine.world_size,
    }


def assert_same_step(many: dict, one: dict) -> None:
    """The step of W ranks (`many`) is the one-process step (`one`): losses, gradients, update
    (tolerances: tests/integration/test_distributed_equivalence.py's docstring)."""
    import pytest

    for key in ("loss", "matching", "caption"):
        assert many[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    scale = max(grad.abs().max() for grad in one["grads"].values())
    for name, grad in one["grads"].items():
        if grad.abs().max() < 1e-4 * scale:  # zero in theory (a bias right before BatchNorm): noise in both
            assert many["grads"][name].abs().max() < 1e-4 * scale, name
        else:
            assert torch.allclose(many["grads"][name], grad, rtol=1e-4, atol=1e-4), name
    start = dict(build_model(make_recipe(True)).named_parameters())
    moved = 0
    for name, param in one["params"].items():
        update_one, update_many = param - start[name].detach(), many["params"][name] - start[name].detach()
        assert torch.allclose(update_many, update_one, rtol=1e-4, atol=1e-4), name
        moved += int(update_one.abs().max() > 0)
    assert moved > 10  # the step really changed the model


def make_engine(backend: str, recipe: VSRNRecipe) -> Engine:
    if backend == "accelerate":
        return cpu_engine()
    from vldist.distributed.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(recipe.config)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]  # gather | local | ragged | accumulate
    backend = sys.argv[3] if len(sys.argv) > 3 else "accelerate"  # or jobs/deepspeed/zeroN.json
    random.seed(0)
    extra = [] if backend == "accelerate" else ["engine.backend=deepspeed", f"engine.deepspeed_config={backend}"]
    recipe = make_recipe(mode != "local", *extra)
    engine = make_engine(backend, recipe)
    result = step(engine, recipe, ragged=mode == "ragged", micro_batches=2 if mode == "accumulate" else 1)
    if engine.is_main:
        torch.save(result, out)
    engine.close()
