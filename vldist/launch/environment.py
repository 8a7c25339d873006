"""Map a launcher's environment onto the variables torch.distributed reads, and say what in it
would break a restart.

torchrun and `accelerate launch` already set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. Under Slurm, `srun` starts one task per rank and sets SLURM_* instead (open_clip's
`world_info_from_env` does the same mapping). Only tasks of an srun step are mapped: the batch
script itself, or a plain `python` inside an allocation, stays a single process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, MutableMapping


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("node[1-4],gpu7" -> "node1"), via scontrol."""
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    raise RuntimeError(
        f"cannot expand the Slurm node list {nodelist!r} (scontrol unavailable): set MASTER_ADDR to the first "
        "node's address, as cluster/slurm/train.sbatch does"
    )


def adopt_slurm_environment(env: MutableMapping[str, str] = os.environ) -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from an srun step; True if it did."""
    if "RANK" in env or "SLURM_STEP_NUM_TASKS" not in env:
        return False
    world_size = int(env["SLURM_STEP_NUM_TASKS"])
    if world_size <= 1:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(world_size)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault(
        "MASTER_ADDR", _first_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    )
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return True


def adopt_single_process_environment(env: MutableMapping[str, str] = os.environ) -> bool:
    """A plain `python -m vldist.train` (no torchrun, srun or Ray) as a world of one: fill RANK,
    WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT (a free loopback port); True if it did.

    DeepSpeed needs them: without them `deepspeed.init_distributed` looks for an MPI launcher and
    dies importing mpi4py. Accelerate needs nothing (it stays out of torch.distributed)."""
    if any(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return False
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(port))
    return True


def rejoin_warning(env: Mapping[str, str] = os.environ) -> str | None:
    """The line to say at the start of a torchrun job whose lost node could not rejoin, or None.

    torchrun >= 2.4 shares its rendezvous store with the ranks (TORCHELASTIC_USE_AGENT_STORE=True)
    unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is in the agents' environment; a surviving agent
    then never publishes a new round's master address, and a node started again after it was lost
    waits for it until the rendezvous times out (pytorch/pytorch#147064). That matters only where
    the job spans nodes (GROUP_WORLD_SIZE) and allows restarts (TORCHELASTIC_MAX_RESTARTS); the
    ranks inherit every one of these variables from their agent."""
    try:
        nodes, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    if nodes < 2 or restarts < 1 or not shared:
        return None
    return (
        f"torchrun: this job spans {nodes} nodes and restarts its ranks (--max-restarts {restarts}), but "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not set: a node lost and started again could not rejoin (its "
        "agent and the others' wait for each other until the rendezvous times out; pytorch/pytorch#147064). Set "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's environment before torchrun "
        "(cluster/torchrun/train.sh does; docs/preemption.md)."
    )
