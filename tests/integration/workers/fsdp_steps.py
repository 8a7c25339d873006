"""Steps under engine.backend=fsdp on this rank's slice of fixed global batches; rank 0 saves the outcomes.

Run by tests/integration/test_fsdp.py under torchrun, one launch for every case (engines one
after another in the same process group):

    python fsdp_steps.py OUT [SHARD_SIZE]

OUT gets {"gather": VSRN's step (equivalence_step.py), "accumulate": the same global batch in
2 micro-batches (each with the collectives it ran, by op), "two_optimizers": a GAN-like model with a frozen part, "cached": VSRN without BatchNorm in 2
micro-batches under train.accumulate_negatives, "held": the fraction of
the parameters each rank holds, "slices": each rank's slice of the first parameter}; SHARD_SIZE sets engine.fsdp_shard_size (hybrid sharding) and runs the gather step alone.
"""

import sys

import accumulate_negatives_step as cached  # this directory is on sys.path
import equivalence_step as worker
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from vldist.distributed.collectives import gather_objects
from vldist.distributed.fsdp_engine import FSDPEngine
from vldist.recipes.jobs import load_config

ROWS = 8


def fsdp_engine(shard_size: str | None) -> FSDPEngine:
    hybrid = [f"engine.fsdp_shard_size={shard_size}"] if shard_size else []
    return FSDPEngine(load_config("vsrn", ["train.device=cpu", "engine.backend=fsdp", *hybrid]))


def whole(result: dict) -> dict:
    """Collective. The step's gradients as whole tensors (FSDP2 leaves each rank its slice)."""
    result["grads"] = {n: g.full_tensor() for n, g in result["grads"].items()}
    return result


class Adversaries(nn.Module):
    """A generator, a critic and a frozen reference, each a unit of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.generator = nn.Linear(4, 6)
        self.critic = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
        self.reference = nn.Linear(4, 6).requires_grad_(False)

    def forward(self, x, update):
        fake = self.generator(x)
        if update == "critic":
            fake = fake.detach()
        anchor = self.reference(x)
        return self.critic(fake).sum() + (fake - anchor).pow(2).sum() * (update == "generator")


def adversarial_steps(engine, model, rows) -> dict:
    """Two steps of two updates each (critic, then generator), as the trainer takes them."""
    optimizers = {
        "critic": torch.optim.Adam(model.critic.parameters(), lr=0.1),
        "generator": torch.optim.Adam(model.generator.parameters(), lr=0.1),
    }
    wrapped = engine.setup(model, optimizers) if engine else model
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(ROWS, 4, generator=g)
        for update in ("critic", "generator"):
            wrapped.zero_grad(set_to_none=True)  # the generator's loss reaches the critic
            share = wrapped(x[rows], update) / ROWS
            if engine:
                engine.backward(share)
                engine.step(update, 0.5)
            else:
                share.backward()
                torch.nn.utils.clip_grad_norm_(optimizers[update].param_groups[0]["params"], 0.5)
                optimizers[update].step()
    return engine.model_state_dict() if engine else {k: v.clone() for k, v in model.state_dict().items()}


def main(out: str, shard_size: str | None) -> None:
    results = {}
    recipe = worker.make_recipe(True, "engine.backend=fsdp")
    cases = (("gather", 1),) if shard_size else (("gather", 1), ("accumulate", 2))
    for mode, micro_batches in cases:
        engine = fsdp_engine(shard_size)
        with CommDebugMode() as comms:
            results[mode] = whole(worker.step(engine, recipe, micro_batches=micro_batches))
        results[mode]["collectives"] = {str(op): n for op, n in comms.get_comm_counts().items()}
        if mode == "gather":
            local = sum(p.to_local().numel() for p in engine.unwrap().parameters())
            total = sum(p.numel() for p in engine.unwrap().parameters())
            results["held"] = gather_objects(local / total)
            results["mesh"] = engine.mesh.shape
            first = next(engine.unwrap().parameters())
            results["slices"] = gather_objects(first.to_local().detach().clone())  # which ranks hold which rows
        engine.close(keep_process_group=True)
    if shard_size:  # hybrid: the layout and the step are what is asked (4 ranks on 2 cores are slow)
        if engine.rank == 0:
            torch.save(results, out)
        dist.destroy_process_group()
        return

    engine = fsdp_engine(shard_size)  # train.accumulate_negatives: 2 micro-batches, every negative
    results["cached"] = whole(cached.cached_step(engine, cached.make_recipe("accelerate", 2, "engine.backend=fsdp"), 2))
    engine.close(keep_process_group=True)

    engine = fsdp_engine(shard_size)
    rank, world = engine.rank, engine.world_size
    mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    results["two_optimizers"] = {
        "fsdp": adversarial_steps(engine, Adversaries(), mine),
        "direct": adversarial_steps(None, Adversaries(), slice(0, ROWS)),  # one process, the whole batch
    }
    engine.close(keep_process_group=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
