"""Ray jobs on several nodes: a Ray head and a worker node made of network namespaces on this
machine (tests/netns.py), each with its own address in 198.18.0.0/15 and its own Ray directory, one
CPU each, so that a group of two workers takes one on each node. `ray job submit` runs on the head.

- The headline command, `ray job submit --working-dir . -- python -m vldist.train vsrn`, with the
  embedded default on nodes that do not share the directories Ray unpacks the job into: each node
  builds the set in its own data home (the VLDIST_DATA_HOME of its `ray start`), none in the
  unpacked checkout; submitted again once finished, the run is refused, not redone.
- A node lost mid-run and brought back ends the run with the weights of an uninterrupted one, also
  when the nodes share no disk (checkpoints in an S3 store); an elastic group carries on without it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    PREEMPT_JOB,
    PREEMPT_STEPS,
    SMALL_EMBEDDED_SETS,
    SMALL_VSRN,
    assert_same_weights,
    weights,
)
from netns import Nodes, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no test nodes: {unavailable()}")
pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("--working-dir", str(REPO))  # the checkout, shipped as a user would

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
RAY_PORT, DASHBOARD_PORT = 6379, 8265  # inside the nodes' namespaces: nothing else holds them
WAIT_FOR_NODES = """import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.time() + 120
while sum(node["Alive"] for node in ray.nodes()) < int(sys.argv[2]):
    assert time.time() < deadline, ray.nodes()
    time.sleep(0.5)
"""


def start_ray_node(nodes: Nodes, node: int, env: dict, temps: list[str], hidden: tuple = ()) -> subprocess.Popen:
    """`ray start` on `node`: the head on node 0 (its dashboard on node 0's loopback), a worker node
    joining it elsewhere; one CPU each, so a group of two workers takes one on each node. Its temp
    directory is added to `temps`; the `hidden` directories are empty there (a disk of its own)."""
    role = (
        ["--head", "--port", str(RAY_PORT), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(DASHBOARD_PORT)]
        if node == 0
        else ["--address", f"{nodes.addresses[0]}:{RAY_PORT}"]
    )
    temps.append(tempfile.mkdtemp(prefix="vn", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    # A lost node is declared dead after 3 missed health checks a second apart (Ray's defaults: 5,
    # 3 s apart, each waiting up to 10 s): the tests wait that long after each power-off.
    checks = {
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    return nodes.popen(
        node,
        [
            *RAY,
            "start",
            "--block",
            *role,
            "--num-cpus",
            "1",
            "--node-ip-address",
            nodes.addresses[node],
            "--temp-dir",
            temps[-1],
            "--disable-usage-stats",
        ],
        hidden=hidden,
        env={**env, **checks},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_ray_nodes(nodes: Nodes, count: int, env: dict) -> None:
    subprocess.run(
        nodes.command(0, [sys.executable, "-c", WAIT_FOR_NODES, f"{nodes.addresses[0]}:{RAY_PORT}", str(count)]),
        env=env,
        check=True,
        timeout=180,
        capture_output=True,
    )


def submit_on_head(
    nodes: Nodes, job: list[str], env: dict, options: tuple = (), agent_answered: bool = False
) -> subprocess.Popen:
    """`ray job submit [options]` of `python <job>` on node 0, once its job agent answers (some
    seconds after the dashboard): a probe job is submitted until one is accepted, unless
    `agent_answered` (an earlier job of this head was)."""
    submit = [*RAY, "job", "submit", "--address", f"http://127.0.0.1:{DASHBOARD_PORT}"]
    deadline = time.time() + 120
    while not agent_answered:
        probe = subprocess.run(  # accepted is enough (--no-wait): the probe's end is not waited for
            nodes.command(0, [*submit, "--no-wait", "--", sys.executable, "-c", "pass"]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        agent_answered = probe.returncode == 0
        if not agent_answered:
            assert "No available agent" in probe.stdout + probe.stderr, (probe.stdout + probe.stderr)[-3000:]
            assert time.time() < deadline, "the head's job agent did not come up in 120 s"
            time.sleep(1)
    return nodes.popen(
        0,
        [*submit, *options, "--", sys.executable, *job],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def on_node_0(nodes: Nodes, env: dict, code: str, *args: str) -> str:
    """Python `code` run on node 0 (where the nodes' S3 store answers); its stdout."""
    done = subprocess.run(
        nodes.command(0, [sys.executable, "-c", code, *args]), env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


STORE = "import os, s3fs; fs = s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL'])\n"


def nodes_store(nodes: Nodes, directory: Path, env: dict):
    """A SeaweedFS S3 store on node 0's address, which both nodes reach (and nothing else)."""
    from seaweed import start_s3_store

    def answers(store) -> bool:
        probe = subprocess.run(
            nodes.command(0, [sys.executable, "-c", STORE + "fs.ls('')"]),
            env={**env, **store.environment},
            capture_output=True,
            timeout=60,
        )
        return probe.returncode == 0

    directory.mkdir()
    return start_s3_store(
        directory, ip=nodes.addresses[0], launch=lambda argv, **kw: nodes.popen(0, argv, **kw), answers=answers
    )


class Output:
    """A process's output, read as it comes (a thread), so that a test can wait for a line."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines = process, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not any(re.search(pattern, line) for line in list(self.lines)):
            assert self.process.poll() is None, "".join(self.lines)[-4000:]
            assert time.time() < deadline, f"no {pattern!r} after {timeout} s: " + "".join(self.lines)[-4000:]
            time.sleep(0.2)

    def rest(self, timeout: float) -> str:
        self.process.wait(timeout)
        self.reader.join(30)
        return "".join(self.lines)


def ray_run_losing_node_1(
    planted_shards, tmp_path, workers: str, rejoin: bool, own_disks: bool = False
) -> tuple[str, list[str]]:
    """A head and a worker node of one CPU each; `ray job submit` of the preemption job on the head
    with `ray.num_workers=workers`; at step 9 node 1 loses every process (its raylet and its worker)
    and, if `rejoin`, is started again. `own_disks`: node 1 does not see node 0's run directory
    (each node has its own), the shards and the checkpoints are in an S3 store on node 0, and the
    final checkpoint is fetched from there into tmp_path/"final". Returns the job's output (it
    succeeded) and the nodes' addresses."""
    pytest.importorskip("ray")
    # RAY_TRAIN_...: a node lost is marked dead some seconds after Ray Train has already decided to
    # start the whole group again; it then waits this long for the lost node's CPU before going on
    # (60 s by default: docs/preemption.md)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    }
    run_dir = tmp_path / "runs"
    run_dir.mkdir()  # a mount point, on node 1, where own_disks
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"ray.storage_path={run_dir}",
        f"ray.num_workers={workers}",
        "ray.max_failures=2",
        "train.save_every_steps=8",
        *PREEMPT_JOB,
    ]
    temps = []
    try:
        with Nodes(2) as nodes:
            if own_disks:
                store = nodes_store(nodes, tmp_path / "s3", env)
                env.update(store.environment)  # on the nodes, as a cluster sets them (cluster/ray/README.md)
                on_node_0(
                    nodes,
                    env,
                    STORE + "fs.mkdir('vldist-tests'); fs.put(*__import__('sys').argv[1:], recursive=True)",
                    str(planted_shards),
                    "vldist-tests/planted",
                )
                job += ["data.shards=s3://vldist-tests/planted", "output.checkpoint_dir=s3://vldist-tests/run"]
            start_ray_node(nodes, 0, env, temps)
            start_ray_node(nodes, 1, env, temps, hidden=(run_dir,) if own_disks else ())
            wait_for_ray_nodes(nodes, 2, env)
            output = Output(submit_on_head(nodes, job, env))
            output.wait_for(r"step 9/", timeout=300)  # rank 0's progress, wherever it runs
            nodes.power_off(1)
            if rejoin:
                start_ray_node(nodes, 1, env, temps, hidden=(run_dir,) if own_disks else ())
            out = output.rest(timeout=420)
            if own_disks and output.process.returncode == 0:
                on_node_0(
                    nodes,
                    env,
                    STORE + "fs.get(*__import__('sys').argv[1:], recursive=True)",
                    f"vldist-tests/run/step-{PREEMPT_STEPS:08d}",
                    str(tmp_path / "final"),
                )
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    assert output.process.returncode == 0 and "succeeded" in out, out[-4000:]
    return out, list(nodes.addresses)


def test_ray_workers_on_two_nodes_with_their_own_disks_lose_one_and_resume_from_the_store(
    planted_shards, tmp_path, two_rank_reference
):
    """A head and a worker node whose disks hold different run directories (node 1 does not see
    node 0's), the shards and the checkpoints (output.checkpoint_dir) in an S3 store; `ray job
    submit` on the head places one worker on each. Node 1 then loses every process; started again
    (an empty disk, as a new machine), it rejoins, Ray Train (FailureConfig) starts the group again,
    the rank there downloads the last checkpoint from the store, and the run ends with the steps
    and weights of the uninterrupted 2-rank run; the driver reports rank 0's results wherever rank
    0 ran (no file on a shared disk)."""
    out, addresses = ray_run_losing_node_1(planted_shards, tmp_path, "2", rejoin=True, own_disks=True)
    placed = re.findall(r"\(ip=([\d.]+), pid=\d+\) world_rank=\d", out)  # the group Ray Train started, each time
    assert len(placed) >= 4 and sorted(placed[:2]) == sorted(placed[2:4]) == sorted(addresses), placed
    resumed = re.search(r"resumed from \S+step-(\d+)", out)
    assert resumed and 8 <= int(resumed.group(1)) < PREEMPT_STEPS, out[-4000:]
    assert f"{PREEMPT_STEPS} steps in " in out, out[-4000:]  # the driver's results table, from rank 0's results
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(tmp_path / "final"), weights(two_rank_reference / "checkpoints" / final))


def test_an_elastic_ray_group_that_loses_a_node_carries_on_with_the_worker_left(planted_shards, tmp_path):
    """`ray.num_workers=1:2` (Ray Train's elastic training) on a head and a worker node of one CPU
    each: a worker on each. Node 1 then loses every process and stays down; Ray Train starts the
    group again with the one worker the cluster still has, which resumes the 2-rank checkpoint on
    1 rank (the global batch kept) and ends the run."""
    out, _ = ray_run_losing_node_1(planted_shards, tmp_path, "1:2", rejoin=False)
    run = tmp_path / "runs" / "vsrn"
    resumed = re.search(r"resumed from \S+step-(\d+) .*written by 2 ranks, resumed on 1", out)
    assert resumed and 8 <= int(resumed.group(1)) < PREEMPT_STEPS, out[-4000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 1


def set_digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir()) if f.is_file()}


def test_the_headline_command_with_the_embedded_default_runs_on_two_nodes_and_is_not_run_twice(tmp_path):
    """`ray job submit --working-dir . -- python -m vldist.train vsrn` with the embedded default,
    on a head and a worker node whose Ray directories, where Ray unpacks the shipped checkout, are
    not one disk (node 0's is hidden on node 1): the driver builds nothing; the worker on each node
    builds shards/synth in that node's data home (VLDIST_DATA_HOME, in the environment of each
    node's `ray start`: another directory on each), not in the checkout Ray unpacked (the builder
    shrunk for the test: workers/small_embedded_set), the same bytes on both; the job SUCCEEDS with
    test recall above chance. Submitted again, the finished run is refused in one line, before any
    worker starts, and left as it was. (A job of other settings into a run directory is refused naming them:
    test_ray.py's stop-and-resubmit test, the same check on one node.)"""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PYTHONPATH": SMALL_EMBEDDED_SETS,
    }
    runs = tmp_path / "runs"  # the run directory: on a disk both nodes share
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"ray.storage_path={runs}",
        "ray.num_workers=2",
        "train.max_steps=120",
        "train.validate_every=0",
        "train.lr_decay_epochs=1000",
        *SMALL_VSRN,
        "data.batch_size=16",
        "data.eval_batch_size=64",
        "data.workers=1",
    ]
    temps = []
    homes = [tmp_path / "data-home-0", tmp_path / "data-home-1"]  # each node's VLDIST_DATA_HOME
    for home in homes:
        home.mkdir()  # node 0's: hidden on node 1
    try:
        with Nodes(2) as nodes:
            start_ray_node(nodes, 0, {**env, "VLDIST_DATA_HOME": str(homes[0])}, temps)
            start_ray_node(nodes, 1, {**env, "VLDIST_DATA_HOME": str(homes[1])}, temps, hidden=(temps[0], homes[0]))
            wait_for_ray_nodes(nodes, 2, env)
            first = submit_on_head(nodes, job, env, options=SHIPPED)
            out = first.communicate(timeout=600)[0]
            assert first.returncode == 0 and "succeeded" in out, out[-5000:]
            run = runs / "vsrn"
            metrics_before = (run / "metrics.json").read_bytes()
            again = submit_on_head(nodes, job, env, options=SHIPPED, agent_answered=True)
            refused = again.communicate(timeout=300)[0]
        unpacked = [
            sorted(Path(temp).glob("session_2*/runtime_resources/working_dir_files/_ray_pkg_*")) for temp in temps
        ]
        in_checkout = [path for found in unpacked for path in found if (path / "shards" / "synth").exists()]
        built = [set_digests(home / "synth") if (home / "synth").is_dir() else sorted(home.glob("*")) for home in homes]
        left = [sorted(p.name for p in home.iterdir()) for home in homes]
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    placed = re.findall(r"\(ip=([\d.]+), pid=\d+\) world_rank=\d", out)
    assert sorted(placed) == sorted(nodes.addresses), placed  # one worker on each node
    assert isinstance(built[0], dict) and built[0] == built[1] and "train-000003.tar" in built[0], built
    assert left == [["synth"], ["synth"]] and all(unpacked) and in_checkout == [], (left, unpacked, in_checkout)
    metrics = json.loads(metrics_before)
    assert (
        metrics["world_size"] == 2 and metrics["steps"] == 120 and metrics["config"]["data"]["shards"] == "shards/synth"
    )
    test = metrics["test"]
    # measured in one process over seeds 1-3: rsum 73-90 against chance's 49 on the 64 test images
    assert test["n_images"] == 64 and test["full"]["rsum"] > 1.2 * test["chance"]["rsum"], test
    assert f"Ray run directory {run}: a new run" in out
    assert again.returncode != 0 and "failed" in refused.lower(), refused[-3000:]
    assert (
        f"error: the run in the Ray run directory {run} finished: its newest checkpoint is its last step's, 120"
        in refused
    ), refused[-3000:]
    assert "ray.name=vsrn-2" in refused and "Traceback" not in refused and "world_rank=" not in refused
    assert (run / "metrics.json").read_bytes() == metrics_before
