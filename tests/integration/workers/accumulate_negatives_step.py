"""VSRN steps with train.accumulate_negatives on this rank's slices of a fixed global batch, for
N = 1, 2 and 4 micro-batches in one launch; rank 0 saves each outcome, keyed by N.

Run by tests/integration/test_accumulate_negatives.py under torchrun (1 or 2 gloo processes,
Accelerate's DDP or DeepSpeed ZeRO-2) and in-process: every run must take the step one process
takes on the whole batch. The model has no BatchNorm (model.rrr_layers=0) and no dropout, so
that step is exactly reachable.

    python accumulate_negatives_step.py OUT_FILE BACKEND   (accelerate, or jobs/deepspeed/zeroN.json)
"""

import random
import sys

import equivalence_step as base
import pytest
import torch

from vldist.distributed.collectives import global_sum
from vldist.distributed.engine import Engine
from vldist.training.negative_cache import NegativeCache

NO_BATCHNORM = ("model.rrr_layers=0",)
MICRO_BATCHES = (1, 2, 4)


def make_recipe(backend: str, micro_batches: int = 1, *overrides: str):
    extra = [] if backend == "accelerate" else ["engine.backend=deepspeed", f"engine.deepspeed_config={backend}"]
    return base.make_recipe(
        True,
        *NO_BATCHNORM,
        *extra,
        f"train.grad_accumulation={micro_batches}",
        "train.accumulate_negatives=true",
        *overrides,
    )


def global_values(losses: dict, update: str) -> dict[str, float]:
    """The trainer's `_global_finite` without its checkpoint hint: the ranks' shares summed."""
    totals = global_sum(torch.stack([v.detach().float().reshape(()) for v in losses.values()]))
    return dict(zip(losses, totals.tolist(), strict=True))


def cached_step(engine: Engine, recipe, micro_batches: int) -> dict:
    """One SGD step (lr 0.5) of `micro_batches` per rank through NegativeCache."""
    recipe.uniform_shapes = engine.uniform_shapes
    module = base.build_model(recipe)
    model = engine.setup(module, {"main": torch.optim.SGD(module.parameters(), lr=0.5)})
    batches = [recipe.collate_train(rows) for rows in base.my_rows(engine, False, micro_batches)]
    return base.outcome(engine, NegativeCache(recipe, engine).accumulate(model, batches, "main", global_values))


def assert_whole_batch_step(run: dict, one: dict, label) -> None:
    """`run` (a cached step) took `one`'s step (one process, the whole batch): losses, gradients, update."""
    for key in ("loss", "matching", "caption"):
        assert run[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (label, key)
    for name, grad in one["grads"].items():
        if name in run["grads"]:  # under ZeRO-2 the gradients live in DeepSpeed's partitions
            assert torch.allclose(run["grads"][name], grad, rtol=1e-4, atol=1e-4), (label, name)
    start = dict(base.build_model(make_recipe("accelerate")).named_parameters())
    for name, param in one["params"].items():
        update_one, update_run = param - start[name].detach(), run["params"][name] - start[name].detach()
        assert torch.allclose(update_run, update_one, rtol=1e-4, atol=1e-4), (label, name)


if __name__ == "__main__":
    out, backend = sys.argv[1], sys.argv[2]
    random.seed(0)
    results = {}
    for n in MICRO_BATCHES:
        recipe = make_recipe(backend, n)
        engine = base.make_engine(backend, recipe)
        results[n] = cached_step(engine, recipe, n)
    if engine.is_main:
        torch.save(results, out)
    engine.close()
