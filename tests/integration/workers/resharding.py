"""A checkpoint written on one number of gloo ranks, resumed on another, under each engine.

Run by tests/integration/test_resharding.py under torchrun:

    python resharding.py save DIR      # 3 steps, checkpoint, 3 more steps; rank 0 writes DIR/<engine>/saved.pt
    python resharding.py resume DIR    # resume the checkpoint, 3 steps;     rank 0 writes DIR/<engine>/resumed-W.pt

For each engine in ENGINES (Accelerate with plain and with sharded asynchronous checkpoints,
DeepSpeed ZeRO 1, 2 and 3, then FSDP2 with plain and with sharded checkpoints, one after another in the same process group), through the real Checkpointer. Both modes record the whole fp32 weights and
Adam's moments (gathered from ZeRO's shards with DeepSpeed's own API), the optimizer's step count
and the global loss of each later step; the resuming mode also records each rank's first random
draw. Every step trains on the same global batch of GLOBAL rows whatever the world size, each rank
on its slice, so W ranks take the step one process takes.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from exit_threads import report_at_exit  # this directory is on sys.path

from vldist.checkpoint.manager import Checkpointer
from vldist.data.vocab import Vocab
from vldist.distributed.collectives import gather_objects, global_sum
from vldist.recipes.jobs import load_config

GLOBAL = 12  # rows of every step's batch: divisible by 1, 2 and 3 ranks
ENGINES = {"accelerate": None, "sharded": None, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": None, "fsdp_sharded": None}
# "sharded": Accelerate with torch.distributed.checkpoint files written in the background while the
# next steps train (train.checkpoint_format=sharded, train.async_checkpoints=true); "fsdp": FSDP2 with
# plain checkpoints (whole state gathered on rank 0), "fsdp_sharded": with DCP ones, synchronous


class TinyRecipe:
    """What a Checkpointer reads of a recipe: vocabulary, feature width, model."""

    vocab, feature_dim = Vocab(["red", "circle"]), 3

    @staticmethod
    def build_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_engine(name: str, out: Path, resume: bool):
    stage = ENGINES[name]
    overrides = [
        f"output.dir={out}",
        "train.device=cpu",
        f"data.batch_size={GLOBAL}",
        "train.grad_clip=1.0",
        *(["engine.backend=deepspeed", f"engine.deepspeed_config=jobs/deepspeed/zero{stage}.json"] if stage else []),
        *(["train.resume=latest"] if resume else []),
        *(["train.checkpoint_format=sharded", "train.async_checkpoints=true"] if name == "sharded" else []),
        *(["engine.backend=fsdp"] if name.startswith("fsdp") else []),
        *(["train.checkpoint_format=sharded"] if name == "fsdp_sharded" else []),
    ]
    config = load_config("vsrn", overrides)
    if name.startswith("fsdp"):
        from vldist.distributed.fsdp_engine import FSDPEngine

        return config, FSDPEngine(config)
    if stage:
        from vldist.distributed.deepspeed_engine import DeepSpeedEngine

        return config, DeepSpeedEngine(config)
    from vldist.distributed.accelerate_engine import AccelerateEngine

    return config, AccelerateEngine(config)


def train_step(engine, scheduler, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL, 3, generator=g), torch.randn(GLOBAL, 2, generator=g)
    rows = slice(engine.rank * GLOBAL // engine.world_size, (engine.rank + 1) * GLOBAL // engine.world_size)
    share = (engine.model(x[rows]) - y[rows]).pow(2).sum() / GLOBAL  # this rank's share of the global mean
    engine.backward(share)
    engine.step("main", 1.0)
    scheduler.step()
    return float(global_sum(share.detach()))


def full_state(engine) -> dict:
    """Collective. {parameter: (fp32 weight, exp_avg, exp_avg_sq)}, whole on every rank."""
    out = {}
    params = dict(engine.unwrap().named_parameters())
    if hasattr(engine, "stage"):  # DeepSpeed: each rank holds a slice (ZeRO 1-3)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for n, p in params.items():
            out[n] = (
                safe_get_full_fp32_param(p).clone(),
                safe_get_full_optimizer_state(p, "exp_avg").clone(),
                safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
            )
        return out
    if hasattr(engine, "mesh"):  # FSDP2: each rank holds a slice of every tensor
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        moments = get_optimizer_state_dict(
            engine.model, engine.optimizers["main"], options=StateDictOptions(full_state_dict=True)
        )
        weights = {n: p.full_tensor() for n, p in params.items()}  # on one rank: the live tensors, hence the clones
        return {
            n: (
                weights[n].detach().clone(),
                moments["state"][n]["exp_avg"].clone(),
                moments["state"][n]["exp_avg_sq"].clone(),
            )
            for n in params
        }
    state = engine.optimizers["main"].state
    return {
        n: (p.detach().clone(), state[p]["exp_avg"].clone(), state[p]["exp_avg_sq"].clone()) for n, p in params.items()
    }


def optimizer_steps(engine) -> list[float]:
    """Adam's step count in each of the optimizer's states (ZeRO: one per flat group)."""
    inner = engine.model.optimizer.optimizer if hasattr(engine, "stage") else engine.optimizers["main"]
    return sorted({float(s["step"]) for s in inner.state.values()})


def run(name: str, root: Path, mode: str) -> None:
    out = root / name
    config, engine = make_engine(name, out, resume=mode == "resume")
    model = TinyRecipe.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine.setup(model, {"main": optimizer})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = {"step": 0, "epoch": 0, "epoch_step": 0}
    checkpointer = Checkpointer(config, engine, {"main": scheduler}, TinyRecipe, lambda: dict(state))
    record = {}
    if mode == "save":
        for step in range(3):
            train_step(engine, scheduler, step)
            state["step"] += 1
        checkpointer.save_step(3, 0)  # asynchronous for "sharded": written while the next steps train
    else:
        state.update(checkpointer.load())
        record["first_draws"] = gather_objects(float(torch.rand(())))
    record.update(
        step=state["step"],
        state=full_state(engine),
        optimizer_steps=optimizer_steps(engine),
        lr=scheduler.get_last_lr()[0],
    )
    record["losses"] = [train_step(engine, scheduler, step) for step in range(3, 6)]
    checkpointer.finish()
    if engine.is_main:
        torch.save(record, out / ("saved.pt" if mode == "save" else f"resumed-{engine.world_size}.pt"))
    engine.close(keep_process_group=True)


def main(mode: str, root: str) -> None:
    report_at_exit()  # test_resharding.py checks that no gloo thread is left at the teardown
    for name in ENGINES:
        run(name, Path(root), mode)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
