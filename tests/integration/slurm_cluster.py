"""A real Slurm cluster for tests: slurmctld + slurmd with a private config, on 127.0.0.1 (one
node), or across test nodes (tests/netns.py: the controller and a slurmd on node 0, a slurmd on
every other node, each slurmd with its own NodeName and NodeAddr).

Needs root and Debian's slurmctld, slurmd and slurm-client (.ci/run installs them). Auth and
credentials are off (auth/none), which is only acceptable for a throwaway cluster that no other
machine can reach.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from netns import Nodes

NODE = "vldistnode"


def available() -> str | None:
    """None when a cluster can be started here, else the reason it cannot."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol") if not shutil.which(b)]
    if missing:
        return f"Slurm binaries missing: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path, spool: Path, nodes: Nodes | None) -> str:
    if nodes is None:  # this machine, on loopback
        host, names, addresses = socket.gethostname(), [NODE], ["127.0.0.1"]
        ports = _free_port(), _free_port()
    else:  # inside the nodes' namespaces the default ports are free
        host, names, addresses = nodes.hostnames[0], nodes.hostnames, nodes.addresses
        ports = 6817, 6818
    memory_mb = 4000
    return "\n".join(
        [
            "ClusterName=vldisttest",
            f"SlurmctldHost={host}({addresses[0]})",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/none",
            "CredType=cred/none",
            # A requeued job waits until its killed run's credentials expire (120 s by default; 5 is
            # the least Slurm takes).
            "AuthInfo=cred_expire=5",
            # A node that stops answering is DOWN after 10 s (default 300), and its jobs requeued.
            "SlurmdTimeout=10",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "EnforcePartLimits=ALL",
            # sched_interval: the main scheduling loop every second (60 s by default). Nothing else
            # starts a requeued job once its credentials expired: it waited for that loop's next pass.
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            # %n: each slurmd's own node name, so that several share one directory
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd-%n.log",
            *(
                f"NodeName={name} NodeAddr={address} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 "
                f"RealMemory={memory_mb} State=UNKNOWN"
                for name, address in zip(names, addresses, strict=True)
            ),
            f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"Slurm test cluster: {what} not ready after {timeout:.0f} s")


class SlurmCluster:
    """The running cluster: `run` a client command (sbatch, scontrol, ...) where the controller
    answers, `start_slurmd` again on a node that lost it."""

    def __init__(self, root: Path, nodes: Nodes | None):
        self.nodes = nodes
        self.names = [NODE] if nodes is None else nodes.hostnames
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def run(self, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """On node 0, where the controller is (this machine for a one-node cluster)."""
        argv = argv if self.nodes is None else self.nodes.command(0, argv)
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, **kwargs)

    def job(self, job_id: str) -> str:
        """`scontrol show job`: its JobState=, Restarts=, NodeList= ..."""
        return self.run(["scontrol", "show", "job", job_id]).stdout

    def _daemon(self, argv: list[str], node: int = 0) -> subprocess.Popen:
        kwargs = dict(env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        process = subprocess.Popen(argv, **kwargs) if self.nodes is None else self.nodes.popen(node, argv, **kwargs)
        self.daemons.append(process)
        return process

    def start_slurmd(self, node: int = 0) -> None:
        self._daemon(["slurmd", "-D", "-N", self.names[node]], node)

    def idle_nodes(self) -> int:
        return self.run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split().count("idle")


@contextmanager
def slurm_cluster(root: Path, nodes: Nodes | None = None):
    """Yields the SlurmCluster: one node on 127.0.0.1, or one per test node."""
    (root / "state").mkdir(parents=True, exist_ok=True)
    # the spool holds slurmstepd's sockets, whose paths must fit 108 bytes: a short directory
    spool = Path(tempfile.mkdtemp(prefix="vs", dir="/tmp"))
    cluster = SlurmCluster(root, nodes)
    for name in cluster.names:
        (spool / name).mkdir()
    (root / "slurm.conf").write_text(_config(root, spool, nodes))
    cluster._daemon(["slurmctld", "-D", "-i"])
    try:
        _wait(lambda: cluster.run(["scontrol", "ping"]).stdout.count("UP") > 0, "slurmctld")
        for node in range(len(cluster.names)):
            cluster.start_slurmd(node)
        _wait(lambda: cluster.idle_nodes() == len(cluster.names), "slurmd (every node idle)")
        yield cluster
    finally:
        try:
            cluster.run(["scancel", "--full", "-u", "root"])
            _wait(lambda: not cluster.run(["squeue", "-h"]).stdout.strip(), "empty queue", timeout=30)
        finally:  # the daemons go whatever the queue says
            for p in reversed(cluster.daemons):
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
            shutil.rmtree(spool, ignore_errors=True)
