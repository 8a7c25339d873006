"""Where a Ray driver and its workers meet: a small actor on the driver's node. The driver posts a
stop request (a stop signal it received); the workers read it; rank 0 posts how the run ended (its
results, or where it stopped). Files in the run directory would do the same only where every node
shares that disk; the actor needs nothing but the cluster, so a job whose nodes share no disk (its
checkpoints in object storage) is stopped and reports like any other."""

from __future__ import annotations

import logging

log = logging.getLogger("vldist.ray")


class _Board:
    """The actor's state: one stop reason (the first asked), one outcome (rank 0's last word)."""

    def __init__(self):
        self.stop_reason: str | None = None
        self.outcome: dict | None = None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def read_stop(self) -> str | None:
        return self.stop_reason

    def post_outcome(self, outcome: dict) -> None:
        self.outcome = outcome

    def read_outcome(self) -> dict | None:
        return self.outcome


def open_board():
    """A new board on this (the driver's) node: a lost worker node must not take it along."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(_Board).options(scheduling_strategy=here).remote()


def stop_watch(board):
    """For a worker's StopRequest: the driver's stop reason, or None (also when the board cannot be
    reached: the driver is gone, and Ray ends the workers itself)."""
    import time

    import ray

    quiet_until = 0.0

    def read() -> str | None:
        nonlocal quiet_until
        if time.monotonic() < quiet_until:
            return None
        try:
            reason = ray.get(board.read_stop.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001 - any failure to ask is "no request seen"
            quiet_until = time.monotonic() + 60  # not a 10 s wait every step
            log.warning(
                "the driver's stop board did not answer (%s); training goes on, asking again in 60 s",
                type(err).__name__,
            )
            return None
        return f"{reason} (relayed by the Ray driver)" if reason else None

    return read
