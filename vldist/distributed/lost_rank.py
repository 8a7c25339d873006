"""A collective that failed because another rank is gone (its process or its node died), told
apart from other errors: the command then says so in one line, on every rank that saw it, instead
of a traceback from inside DDP; what brings the run back is in docs/preemption.md, "A node lost"."""

from __future__ import annotations

import re
import socket
from contextlib import contextmanager
from pathlib import Path

from vldist.errors import PeerLost

# What torch's backends say when the other end of a collective went away: gloo's TCP pairs, and
# NCCL's watchdog (a remote process exited, or the collective timed out waiting for it).
LOST_PEER_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
    "Watchdog caught collective operation timeout",
)
# What gloo says when a collective waited engine.timeout_s (the other rank alive but silent).
TIMEOUT_SIGNS = ("Timed out waiting", "Application timeout caused pair closure")


def is_lost_rank_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in LOST_PEER_SIGNS + TIMEOUT_SIGNS)


def _what_failed(error: BaseException) -> str:
    """The backend's own words, without its source location and its advice: 'Read error
    [198.18.0.2]:46255: Connection reset by peer'."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". ")[0].rstrip(".")


@contextmanager
def lost_rank_reported(rank: int, world_size: int, checkpoints: Path):
    """Inside, an error that says another rank is gone becomes PeerLost naming this rank's host
    and where the run carries on from; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as err:
        if world_size < 2 or not is_lost_rank_error(err):
            raise
        resume = f"The same job with train.resume=auto carries on from the newest checkpoint in {checkpoints}"
        if any(sign in str(err) for sign in TIMEOUT_SIGNS):
            raise PeerLost(
                f"rank {rank} on {socket.gethostname()}: a collective waited longer than engine.timeout_s for another "
                f"rank ({_what_failed(err)}): a rank is stopped or far behind (train.hang_timeout_s, set below "
                f"engine.timeout_s, names which). {resume}"
            ) from None
        raise PeerLost(
            f"rank {rank} on {socket.gethostname()} lost another rank of the run ({_what_failed(err)}): a process "
            f"or node of the run died; its launcher's log says which. {resume}"
        ) from None
