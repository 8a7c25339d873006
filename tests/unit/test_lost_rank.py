"""A collective that failed because another rank is gone becomes one line naming this rank's host
and where to carry on from; every other error passes unchanged."""

import socket
from pathlib import Path

import pytest

from vldist.distributed.lost_rank import is_lost_rank_error, lost_rank_reported
from vldist.errors import PeerLost
from vldist.exit_codes import FAILED, exit_status

# as torch 2.14.1's gloo raised it on the surviving node of tests/integration/test_slurm.py
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
    "[198.18.0.2]:46255: Connection reset by peer. This is typically caused by a remote worker hanging or "
    "bugs in the application. Check the logs of the remote worker before reporting an error."
)


def test_a_lost_peer_becomes_one_line_with_the_host_and_where_to_carry_on():
    with pytest.raises(PeerLost) as caught:
        with lost_rank_reported(rank=1, world_size=2, checkpoints=Path("/shared/runs/vsrn/checkpoints")):
            raise RuntimeError(GLOO_RESET)
    message = str(caught.value)
    assert message.startswith(
        f"rank 1 on {socket.gethostname()} lost another rank of the run "
        "(Read error [198.18.0.2]:46255: Connection reset by peer)"
    )
    assert message.endswith("train.resume=auto carries on from the newest checkpoint in /shared/runs/vsrn/checkpoints")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained traceback
    code, line = exit_status(caught.value)
    assert code == FAILED and line == f"error: {message}"


@pytest.mark.parametrize(
    "error, world_size",
    [
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), 2),  # a bug, not a lost rank
        (RuntimeError(GLOO_RESET), 1),  # one process has no peers to lose
        (ValueError("Connection reset by peer"), 2),  # not from a collective
    ],
)
def test_other_errors_pass_unchanged(error, world_size):
    with pytest.raises(type(error)) as caught:
        with lost_rank_reported(rank=0, world_size=world_size, checkpoints=Path("c")):
            raise error
    assert caught.value is error


def test_the_signs_of_each_backend_are_recognised():
    assert is_lost_rank_error(RuntimeError(GLOO_RESET))
    assert is_lost_rank_error(RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"))
    assert not is_lost_rank_error(RuntimeError("CUDA out of memory"))
