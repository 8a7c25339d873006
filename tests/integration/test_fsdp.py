"""engine.backend=fsdp (FSDP2, `fully_shard`) on 2 gloo processes on the CPU.

- 2 ranks take the step of one process on the whole batch (loss, every gradient, the update),
  also accumulated over 2 micro-batches, where the first micro-batch reduces no gradient (the
  collectives counted by torch's CommDebugMode: as many reduce-scatters as one micro-batch).
- Each rank holds half of every parameter (dim-0 slices, the two halves different).
- train.accumulate_negatives over 2 micro-batches takes the whole batch's step.
- Two optimizers (a GAN's critic and generator, the generator's loss flowing through the critic)
  and a frozen reference module: two steps match a direct computation on the whole batch.
- `python -m vldist.train ... engine.backend=fsdp` under torchrun trains, evaluates (rank 0, on a
  plain copy of the whole weights), writes sharded (DCP) checkpoints and exports whole weights.
- train.compile is refused by name (what was measured: vldist/training/compiling.py).
Resuming on 1, 2 and 3 ranks exactly (weights, Adam moments, LR, loss curve): test_resharding.py;
hybrid sharding across two nodes: test_multinode.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import accumulate_negatives_step as cached  # noqa: E402
import equivalence_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from fsdp_steps import Adversaries  # noqa: E402
from helpers import SMALL_VSRN, torchrun, train_vsrn, weights  # noqa: E402

from vldist.checkpoint.sharded_state import read_model_state  # noqa: E402
from vldist.export import export  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "fsdp_steps.py"
REDUCE_SCATTER = "c10d._reduce_scatter_base_"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "steps.pt"
    proc = subprocess.run([*torchrun(2), str(WORKER), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def test_two_fsdp_ranks_take_the_step_of_one_process(two_ranks):
    one = worker.step(cpu_engine(), worker.make_recipe(gather=True))
    assert two_ranks["gather"]["world_size"] == 2
    worker.assert_same_step(two_ranks["gather"], one)


def test_each_rank_holds_its_own_half_of_every_parameter(two_ranks):
    assert two_ranks["mesh"] == (2,)
    assert all(abs(share - 0.5) < 0.01 for share in two_ranks["held"])  # dim 0 split in two, rounded up on rank 0
    first, second = two_ranks["slices"]
    assert first.shape[1:] == second.shape[1:] and not torch.equal(first[: len(second)], second)


def test_accumulated_micro_batches_reduce_gradients_once(two_ranks):
    """2 micro-batches of 4 rows: the step of the mean of their losses, as one process takes it
    (that one process's accumulated step against a direct computation: test_distributed_equivalence.py)."""
    one = worker.step(cpu_engine(), worker.make_recipe(gather=True), micro_batches=2)
    worker.assert_same_step(two_ranks["accumulate"], one)
    once, twice = two_ranks["gather"]["collectives"], two_ranks["accumulate"]["collectives"]
    assert once[REDUCE_SCATTER] > 0
    assert twice[REDUCE_SCATTER] == once[REDUCE_SCATTER]  # the first micro-batch reduced nothing


def test_accumulate_negatives_takes_the_whole_batch_step_under_fsdp2(two_ranks):
    """2 micro-batches on each of 2 FSDP2 ranks with train.accumulate_negatives: the step of one
    process on the whole batch (every negative), through the engine's micro_batch and backward."""
    one = worker.step(cpu_engine(), worker.make_recipe(True, *cached.NO_BATCHNORM))
    assert two_ranks["cached"]["world_size"] == 2
    assert len(two_ranks["cached"]["grads"]) == len(one["grads"])
    cached.assert_whole_batch_step(two_ranks["cached"], one, "fsdp, 2 ranks x 2 micro-batches")


def test_two_optimizers_and_a_frozen_module_match_a_direct_computation(two_ranks):
    fsdp, direct = two_ranks["two_optimizers"]["fsdp"], two_ranks["two_optimizers"]["direct"]
    assert fsdp.keys() == direct.keys()  # the model's own parameter names
    start = Adversaries().state_dict()
    for name, value in direct.items():
        assert torch.allclose(fsdp[name], value, rtol=1e-5, atol=1e-6), name
        moved = not torch.equal(value, start[name])
        assert moved == (not name.startswith("reference")), name  # both updates moved, the frozen part did not


def test_train_cli_writes_sharded_checkpoints_and_exports_whole_weights(planted_shards, tmp_path):
    out = tmp_path / "run"
    job = [
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        *SMALL_VSRN,
        "engine.backend=fsdp",
        "engine.sync_batchnorm=true",  # running statistics the same on every rank: DCP keeps one rank's
        "train.checkpoint_format=sharded",
        "train.epochs=1",
        "train.save_every_steps=3",
        "train.log_every=1",
    ]
    proc = subprocess.run(
        [*torchrun(2), "-m", "vldist.train", *job, "train.max_steps=3"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    step3 = out / "checkpoints" / "step-00000003"
    assert (step3 / "sharded").is_dir() and (step3 / "model.safetensors").is_file()  # the run's last: whole too
    meta = json.loads((step3 / "meta.json").read_text())
    assert meta["engine"] == "fsdp" and meta["world_size"] == 2 and meta["fsdp_shard_size"] == 2

    export(out, tmp_path / "export", "step-3")
    exported, saved = weights(tmp_path / "export"), weights(step3)
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], v) for k, v in saved.items())
    sliced = read_model_state(step3 / "sharded")  # each rank's slices, written by that rank
    assert sliced.keys() == saved.keys() and all(torch.equal(sliced[k], v) for k, v in saved.items())


def test_compile_is_refused_by_name(planted_shards, tmp_path, capsys):
    mode = "model"  # and step: the same check
    code, err = train_vsrn(
        capsys,
        f"data.shards={planted_shards}",
        f"output.dir={tmp_path / 'run'}",
        "engine.backend=fsdp",
        f"train.compile={mode}",
        *SMALL_VSRN,
    )
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"train.compile={mode} under engine.backend=fsdp" in err and "train.compile=none" in err
