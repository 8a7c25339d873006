"""A real one-node Slurm cluster on 127.0.0.1 for tests: slurmctld + slurmd with a private config.

Needs root and Debian's slurmctld, slurmd and slurm-client (.ci/run installs them). Auth and
credentials are off (auth/none), which is only acceptable for a throwaway loopback cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

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


def _config(root: Path) -> str:
    host = socket.gethostname()
    memory_mb = 4000
    return "\n".join([
        "ClusterName=vldisttest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/none", "CredType=cred/none",
        # A requeued job waits until its killed run's credentials expire (120 s by default).
        "AuthInfo=cred_expire=10",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SlurmUser=root", "SlurmdUser=root", "MpiDefault=none", "ReturnToService=2",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "EnforcePartLimits=ALL", "SchedulerParameters=batch_sched_delay=0",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 "
        f"RealMemory={memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _wait(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"Slurm test cluster: {what} not ready after {timeout:.0f} s")


@contextmanager
def slurm_cluster(root: Path):
    """Yields the environment (with SLURM_CONF) in which sbatch/squeue talk to the cluster."""
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_config(root))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    try:
        _wait(lambda: subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True).stdout.count("UP") > 0,
              "slurmctld")
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", NODE], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout,
              "slurmd (node idle)")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        _wait(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip(),
              "empty queue", timeout=30)
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
