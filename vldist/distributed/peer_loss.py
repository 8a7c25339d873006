"""A collective that failed because another rank is gone (its process or its node died), told
apart from other errors: the command then says so in one line, on every rank that saw it, instead
of a traceback from inside DDP; what brings the run back is in docs/preemption.md, "A node lost"."""

from __future__ import annotations

import re
import socket
from contextlib import contextmanager
from pathlib import Path

# What torch's backends say when the other end of a collective went away: gloo's TCP pairs, and
# NCCL's watchdog (a remote process exited, or the collective timed out waiting for it).
LOST_PEER_SIGNS = (
    "Connection reset by peer", "Connection closed by peer", "Broken pipe",
    "remote process exited or there was a network error", "Watchdog caught collective operation timeout",
)


class PeerLost(RuntimeError):
    """This rank's collective failed because another rank of the run is gone."""


def is_peer_loss(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in LOST_PEER_SIGNS)


def _what_failed(error: BaseException) -> str:
    """The backend's own words, without its source location and its advice: 'Read error
    [198.18.0.2]:46255: Connection reset by peer'."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". ")[0].rstrip(".")


@contextmanager
def peer_loss_reported(rank: int, world_size: int, checkpoints: Path):
    """Inside, an error that says another rank is gone becomes PeerLost naming this rank's host
    and where the run carries on from; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as err:
        if world_size < 2 or not is_peer_loss(err):
            raise
        raise PeerLost(
            f"rank {rank} on {socket.gethostname()} lost another rank of the run ({_what_failed(err)}): a process "
            "or node of the run died; its launcher's log says which. The same job with train.resume=auto "
            f"carries on from the newest checkpoint in {checkpoints}"
        ) from None
