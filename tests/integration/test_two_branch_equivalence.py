"""Both two-branch recipes on W = 2 gloo ranks (DDP) take the same steps as one process on the
whole batch: the top-K violators, the neighbourhood pairs and the similarity network's negative
sentences all come from the global batch; in phrase batches, each phrase's negative regions from
its own image (or, "batch", every rank's), its region's negative phrases from every rank, never a
copy of its image held by the other rank."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import two_branch_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from helpers import run_on_two_ranks  # noqa: E402

from vldist.shards.convert.images import one_thread  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("two_branch") / "two.pt"
    run_on_two_ranks(Path(worker.__file__), out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_process() -> dict:
    with one_thread():  # as each torchrun rank (OMP_NUM_THREADS=1): the same float sums
        engine = cpu_engine()
        return {job: worker.run(engine, job, "even") for job in worker.JOBS}


@pytest.mark.parametrize("split", list(worker.SPLITS))
@pytest.mark.parametrize("job", list(worker.JOBS))
def test_two_ranks_take_the_steps_of_one_process(two_ranks, one_process, job, split):
    two, one = two_ranks[(job, split)], one_process[job]
    assert two["world_size"] == 2 and one["world_size"] == 1
    losses = [s["losses"]["loss"] for s in one["steps"]]
    assert losses[0] > 0.1 and len(set(losses)) == len(losses)  # active hinges, and the steps moved the model
    for step, (got, expected) in enumerate(zip(two["steps"], one["steps"], strict=True)):
        assert got["losses"]["loss"] == pytest.approx(expected["losses"]["loss"], rel=1e-5), step
        assert got["grads"].keys() == expected["grads"].keys()
        # Float32 sums in another order differ by ~1e-6 of the step's largest gradient. That
        # matters for the bias of the FC before each branch's batch norm: the norm subtracts it
        # again, so its true gradient is 0 and both runs hold rounding noise of that size.
        scale = max(float(g.abs().max()) for g in expected["grads"].values())
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5 * scale, msg=f"{step} {name}")
        for name, value in expected["state"].items():
            torch.testing.assert_close(
                got["state"][name].float(),
                value.float(),
                rtol=1e-4,
                atol=worker.LR * 1e-5 * scale * (step + 1) + 1e-5,
                msg=f"{step} {name}",
            )
