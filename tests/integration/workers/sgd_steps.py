"""What the equivalence workers share: a rank's slice of a fixed global batch, and a few SGD
steps on it with the losses, gradients and weights of each step recorded."""

import torch

from vldist.distributed.collectives import global_sum
from vldist.distributed.engine import Engine


def my_slice(items: list, engine: Engine, cut: int) -> list:
    """The whole list in one process; rank 0 the first `cut` items and rank 1 the rest on two."""
    if engine.world_size == 1:
        return items
    return items[:cut] if engine.rank == 0 else items[cut:]


def sgd_steps(engine: Engine, recipe, module: torch.nn.Module, batch: dict, steps: int, lr: float) -> list[dict]:
    """`steps` SGD steps on the same batch (SGD's update shows any error in the gradient's scale;
    Adam's first step is about lr * sign(gradient)). Losses are global: the ranks' shares summed."""
    model = engine.setup(module, {"main": torch.optim.SGD(recipe.optimizer_groups(module)["main"], lr=lr)})
    model.train()
    out = []
    for step in range(steps):
        recipe.start_step(step)
        losses = recipe.training_losses(model, batch)
        engine.backward(losses["loss"])
        grads = {n: p.grad.clone() for n, p in engine.unwrap().named_parameters() if p.grad is not None}
        engine.step("main", None)
        out.append(
            {
                "losses": {k: float(global_sum(v)) for k, v in losses.items()},
                "grads": grads,
                "state": engine.model_state_dict(),
            }
        )
    return out
