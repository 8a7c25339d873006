"""A checkpoint resumes on another number of ranks: 2 -> 1, 1 -> 2 and 2 -> 3 gloo processes, under
Accelerate (DDP; plain checkpoints, and sharded ones written asynchronously while training goes on)
DeepSpeed ZeRO 1, 2 and 3, and FSDP2 (engine.backend=fsdp; plain and sharded checkpoints) (real
torchrun, real DeepSpeed, the real Checkpointer; tests/integration/workers/resharding.py).

After loading, every parameter's fp32 weight and Adam moments equal the saved ones exactly, Adam's
step count and the LR schedule carry over, and the next steps' losses are those the saving run took
after its checkpoint (the same global batches: W ranks take the step one process takes). Ranks
that could not get a saved RNG state of their own draw different numbers. No rank runs a gloo
thread into its interpreter's teardown, where one aborted a rank once ("terminate called without
an active exception"; vldist/distributed/teardown.py).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from exit_threads import assert_no_gloo_thread_at_exit  # noqa: E402
from helpers import torchrun  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "resharding.py"
ENGINES = ["accelerate", "sharded", "zero1", "zero2", "zero3", "fsdp", "fsdp_sharded"]


def _torchrun(ranks: int, mode: str, root: Path) -> None:
    cmd = [*torchrun(ranks), str(WORKER), mode, str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_no_gloo_thread_at_exit(proc.stderr, ranks)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written by 1 and by 2 ranks, for every engine: {ranks: root}."""
    roots = {ranks: tmp_path_factory.mktemp(f"saved-by-{ranks}") for ranks in (1, 2)}
    for ranks, root in roots.items():
        _torchrun(ranks, "save", root)
    return roots


@pytest.mark.parametrize(("written_by", "resumed_on"), [(2, 1), (1, 2), (2, 3)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(saved, written_by, resumed_on):
    root = saved[written_by]
    _torchrun(resumed_on, "resume", root)
    for engine in ENGINES:
        before = torch.load(root / engine / "saved.pt", weights_only=True)
        after = torch.load(root / engine / f"resumed-{resumed_on}.pt", weights_only=True)
        assert after["step"] == before["step"] == 3, engine
        assert after["optimizer_steps"] == before["optimizer_steps"] == [3.0], engine
        assert after["lr"] == before["lr"] == 0.025, engine  # StepLR halved it at step 2
        assert set(after["state"]) == set(before["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name, (weight, exp_avg, exp_avg_sq) in before["state"].items():
            got = after["state"][name]
            assert torch.equal(got[0], weight), (engine, name, "weight")
            assert torch.equal(got[1], exp_avg), (engine, name, "exp_avg")
            assert torch.equal(got[2], exp_avg_sq), (engine, name, "exp_avg_sq")
        # The loss curve carries on where it was: the saving run's next three steps, to float rounding
        # (the gradient is summed over another number of ranks).
        assert torch.allclose(torch.tensor(after["losses"]), torch.tensor(before["losses"]), rtol=1e-5, atol=0), engine
        draws = after["first_draws"]
        assert len(draws) == resumed_on and len(set(draws)) == resumed_on, engine  # no rank shares a stream
