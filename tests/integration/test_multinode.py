"""Runs across hosts, on "nodes" made of network namespaces on this machine (tests/netns.py:
their own hostnames and /etc/hosts, addresses in 198.18.0.0/15 that exist only inside them).

- torchrun on two nodes, its c10d rendezvous on the first, takes the same training step as one
  process on the whole batch (the cross-rank negatives gathered across hosts), also when each
  node's /etc/hosts maps its own name to 127.0.1.1 as Debian writes it: gloo would then tell the
  other node to connect to 127.0.1.1, and vldist picks the interface towards MASTER_ADDR instead.
- A shard set on one node's disk only is reported with that node's name.
- FSDP2 hybrid sharding (engine.fsdp_shard_size=2 on 2 nodes x 2 ranks) shards within a node,
  replicates across the nodes, and takes the step of one process.
- A node lost mid-run and brought back under torchrun (cluster/torchrun/train.sh) ends the run with
  the weights of an uninterrupted one. (Slurm's: tests/integration/test_slurm.py; Ray's, and Ray
  jobs on several nodes: tests/integration/test_ray_nodes.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import equivalence_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from helpers import (  # noqa: E402
    PREEMPT_JOB,
    PREEMPT_STEPS,
    SMALL_EMBEDDED_SETS,
    SMALL_VSRN,
    assert_same_weights,
    wait_for_step,
    weights,
)
from netns import Nodes, unavailable  # noqa: E402

from vldist.exit_codes import HUNG  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no test nodes: {unavailable()}")
RENDEZVOUS_PORT = 29400  # inside the first node's namespace: no other process can hold it
TORCHRUN_SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "torchrun" / "train.sh"


@pytest.fixture(scope="module")
def one_process():
    return worker.step(cpu_engine(), worker.make_recipe(gather=True))


def torchrun_command(nodes: Nodes, node: int, per_node: int, script: list[str], run_id: str) -> list[str]:
    """`torchrun --nnodes N --nproc-per-node per_node` for `node`, the rendezvous on node 0 (by
    address, and told it is the host: its own name may resolve to loopback)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes.count),
        "--nproc-per-node",
        str(per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{nodes.addresses[0]}:{RENDEZVOUS_PORT}",
        "--rdzv-id",
        run_id,
        *(["--rdzv-conf", "is_host=1"] if node == 0 else []),
        "--local-addr",
        nodes.addresses[node],
        *script,
    ]


def torchrun_on_nodes(
    nodes: Nodes, per_node: int, script: list[str], run_id: str, hidden: dict[int, tuple] | None = None
) -> list[subprocess.Popen]:
    """torchrun_command started on every node, its output captured; `hidden`: per node, the
    directories its disk lacks."""
    return [
        nodes.popen(
            i,
            torchrun_command(nodes, i, per_node, script, run_id),
            hidden=(hidden or {}).get(i, ()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nodes.count)
    ]


def finished(processes: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """The outputs of every process, once each has exited 0 (else all of them in the failure)."""
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), "\n\n".join(
        f"node {i}, exit {p.returncode}:\n{out[-3000:]}"
        for i, (p, out) in enumerate(zip(processes, outputs, strict=True))
    )
    return outputs


@pytest.mark.parametrize(
    "per_node, own_name_loopback", [(1, True), (2, False)], ids=["1-rank-each-hostname-on-loopback", "2-ranks-each"]
)
def test_torchrun_on_two_nodes_takes_the_step_of_one_process(one_process, tmp_path, per_node, own_name_loopback):
    out = tmp_path / "step.pt"
    with Nodes(2, own_name_loopback=own_name_loopback) as nodes:
        finished(
            torchrun_on_nodes(
                nodes, per_node, [str(Path(worker.__file__)), str(out), "gather", "accelerate"], tmp_path.name
            )
        )
    many = torch.load(out, weights_only=True)
    assert many["world_size"] == 2 * per_node
    worker.assert_same_step(many, one_process)


def test_a_shard_set_that_one_node_lacks_is_named_with_that_node(planted_shards, tmp_path):
    """The set on node 0's disk only (hidden on node 1): the job stops with the path and node 1's
    name, and what to do, instead of a rank failing somewhere in the data pipeline."""
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={tmp_path / 'run'}",
        "train.epochs=1",
        *SMALL_VSRN,
    ]
    with Nodes(2) as nodes:
        processes = torchrun_on_nodes(nodes, 1, job, tmp_path.name, hidden={1: (planted_shards.parent,)})
        outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert processes[0].returncode != 0 and processes[1].returncode != 0  # neither node trains alone
    said = "".join(outputs)  # rank 0, on either node, reports the error of the rank that met it
    assert f"error: shard directory '{planted_shards}' does not exist on node1" in said, [
        line for line in said.splitlines() if "error" in line.lower()
    ]
    assert "put it on a disk they share, on each node, or in object storage" in said


def test_the_embedded_default_is_built_on_every_node_that_lacks_it(tmp_path):
    """`python -m vldist.train vsrn` with the default data.shards (shards/synth), on two nodes whose
    data homes (VLDIST_DATA_HOME, one path on both) are not one disk (node 1's is hidden: empty):
    each node's first rank builds the deterministic set in its own data home, not in the working
    directory, both train on the same bytes, and node 1's copy equals node 0's file for file. The
    builder is shrunk for the test (workers/small_embedded_set/sitecustomize.py); the path it takes
    is the real one.
    The agents allow a restart without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 says once that
    a lost node could not rejoin, and how to fix it."""
    work, home, run = tmp_path / "work", tmp_path / "data-home", tmp_path / "run"
    work.mkdir()
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": SMALL_EMBEDDED_SETS, "VLDIST_DATA_HOME": str(home)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"output.dir={run}",
        "train.max_steps=2",
        "train.validate_every=0",
        *SMALL_VSRN,
        "data.batch_size=16",
        "data.eval_batch_size=16",
    ]
    # in the working directory: the data home's filesystem, the job, then the digests of the set it built there
    script = (
        f'cd {work} && echo "-- data home: $(stat -f -c %T {home})" && "$@" && echo "-- files:" && '
        f"cd {home}/synth && sha256sum -- * | sort -k2"
    )

    def torchrun(node: int) -> list[str]:
        argv = torchrun_command(nodes, node, 1, job, tmp_path.name)
        argv[3:3] = ["--max-restarts", "1"]  # after `python -m torch.distributed.run`
        return argv

    with Nodes(2) as nodes:
        processes = [
            nodes.popen(
                i,
                ["sh", "-c", script, "sh", *torchrun(i)],
                hidden=(home,) if i == 1 else (),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        outputs = finished(processes)
    # node 1's data home was a disk of its own
    assert "-- data home: tmpfs" in outputs[1] and "-- data home: tmpfs" not in outputs[0]
    files = [out[out.rindex("-- files:") :] for out in outputs]
    assert files[0] == files[1] and "manifest.json" in files[0] and "train-000001.tar" in files[0], files
    assert not (work / "shards").exists()  # nothing in the working directory
    assert sorted(p.name for p in home.iterdir()) == ["synth"]  # node 0's: the set alone, no lock file
    # rank 0 says where; node 1's rank logs warnings only
    assert f"building the embedded synthetic dataset in {home / 'synth'} (" in outputs[0]
    metrics = json.loads((run / "metrics.json").read_text())
    assert (
        metrics["world_size"] == 2 and metrics["steps"] == 2 and metrics["config"]["data"]["shards"] == "shards/synth"
    )
    assert metrics["test"]["n_images"] == 64  # the shrunk set: the job read what the nodes built
    warned = "".join(outputs).count(
        "torchrun: this job spans 2 nodes and restarts its ranks (--max-restarts 1), "
        "but TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not set"
    )
    assert warned == 1, outputs


def test_an_output_directory_one_node_does_not_share_is_refused_before_training(planted_shards, tmp_path):
    """Node 1 has a directory of its own at output.dir's path: the run stops at its start, naming
    rank 1's node and what to do, instead of writing checkpoints rank 0 never sees (or resuming
    rank 1 from nothing while rank 0 resumes)."""
    run = tmp_path / "run"
    run.mkdir()  # node 1's mount point
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={run}",
        "train.epochs=1",
        *SMALL_VSRN,
    ]
    with Nodes(2) as nodes:
        processes = torchrun_on_nodes(nodes, 1, job, tmp_path.name + "-out", hidden={1: (run,)})
        outputs = [process.communicate(timeout=240)[0] for process in processes]
    said = "".join(outputs)
    assert processes[0].returncode != 0 and processes[1].returncode != 0, said[-3000:]
    assert f"error: output.dir {run} is not one directory for every rank: rank 1 on node1 does not see" in said, [
        line for line in said.splitlines() if "error" in line.lower()
    ]
    assert "set output.checkpoint_dir to a store URL" in said
    assert not re.search(r'File ".*/vldist/', said)  # one line from each rank (torchrun prints its own traceback)
    assert not (run / "checkpoints").exists()  # nothing trained


def test_a_node_lost_mid_run_comes_back_and_the_run_ends_as_if_never_lost(planted_shards, tmp_path, two_rank_reference):
    """Node 1 loses every process mid-epoch (as a power failure would) and its torchrun is started
    again (as a scheduler would): node 0's agent restarts its rank (--max-restarts), both rejoin the
    rendezvous and resume from the last checkpoint on the disk they share (train.resume=auto); the
    run ends with the steps and weights of the uninterrupted 2-rank run. Each node runs
    cluster/torchrun/train.sh, which sets what a rejoining node needs
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: pytorch/pytorch#147064): no warning."""
    run = tmp_path / "run"
    job = ["vsrn", f"data.shards={planted_shards}", f"output.dir={run}", *PREEMPT_JOB, "train.save_every_steps=4"]
    with Nodes(2) as nodes:

        def start(node: int) -> subprocess.Popen:
            host = " --rdzv-conf is_host=1" if node == 0 else ""  # by address: its own name may be loopback
            env = {
                **os.environ,
                "NNODES": "2",
                "RDZV_ENDPOINT": f"{nodes.addresses[0]}:{RENDEZVOUS_PORT}",
                "RUN_ID": tmp_path.name,
                "PYTHON": sys.executable,  # MAX_RESTARTS: the script's 3
                "TORCHRUN_ARGS": f"--local-addr {nodes.addresses[node]}{host}",
            }
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the script's to set
            return nodes.popen(
                node,
                ["bash", str(TORCHRUN_SCRIPT), *job],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

        first, second = start(0), start(1)
        wait_for_step(run, 9)
        nodes.power_off(1)
        lost_output = second.communicate(timeout=30)[0]
        second = start(1)
        outputs = finished([first, second], timeout=400)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 1, (
        lost_output[-2000:],
        outputs[0][-3000:],
    )
    resumed = re.search(r"resumed from \S+step-(\d+)", "".join(outputs))
    assert resumed and 8 <= int(resumed.group(1)) < PREEMPT_STEPS
    assert "error: rank 0 on node0 lost another rank of the run" in outputs[0]  # one line, then the restart
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not set" not in "".join(outputs)
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(run / "checkpoints" / final), weights(two_rank_reference / "checkpoints" / final))


def test_a_frozen_node_is_named_by_the_other_within_the_hang_timeout(planted_shards, tmp_path):
    """Every process of node 1 stopped (SIGSTOP: its connections stay open, nothing answers): the
    rank on node 0 exits HUNG within train.hang_timeout_s and a margin, naming rank 1 on node1."""
    run = tmp_path / "run"
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={run}",
        *PREEMPT_JOB,
        "train.epochs=20",
        "train.hang_timeout_s=8",
    ]
    with Nodes(2) as nodes:
        processes = torchrun_on_nodes(nodes, 1, job, tmp_path.name)
        wait_for_step(run, 10, processes[0])
        time.sleep(2)  # a heartbeat with rank 1's step on it
        nodes.freeze(1)
        frozen = time.monotonic()
        out = processes[0].communicate(timeout=90)[0]
        took = time.monotonic() - frozen
    assert processes[0].returncode != 0 and took < 8 + 2 * 0.8 + 15, (took, out[-3000:])
    said = re.search(r"error: no rank of the run advanced for \d+ s \(train.hang_timeout_s=8\): (.*)", out)
    assert said, out[-3000:]
    assert re.match(r"rank 1 on node1 \(pid \d+\) stopped responding, last at step \d+", said.group(1)), said.group(1)
    assert "waiting for it: rank 0 on node0" in said.group(1)
    assert f"exitcode  : {HUNG}" in out or f"exitcode: {HUNG}" in out, out[-2000:]  # torchrun's failure table


PROMETHEUS_QUERY = """
import json, sys, time, urllib.parse, urllib.request
url = "http://127.0.0.1:9090"
deadline = time.time() + 60
while True:
    try:
        urllib.request.urlopen(url + "/-/ready", timeout=2)
        break
    except OSError:
        assert time.time() < deadline, "prometheus did not become ready"
        time.sleep(0.3)
if sys.argv[1] == "ready":
    sys.exit(0)
reply = json.load(urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[1]})))
print(json.dumps([[r["metric"], float(r["value"][1])] for r in reply["data"]["result"]]))
"""


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs the prometheus binary (apt-get install prometheus)"
)
def test_prometheus_on_the_first_node_scrapes_every_rank_of_a_two_node_run(planted_shards, tmp_path):
    """metrics.host=node: each rank binds its node's address; rank 0 writes every rank's endpoint
    to one file_sd file; a real Prometheus on node 0, given only that file, scrapes both nodes."""
    targets, config = tmp_path / "targets", tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: vldist\n    honor_labels: true\n"
        f"    file_sd_configs: [{{files: ['{targets}/*.json'], refresh_interval: 1s}}]\n"
    )
    run = tmp_path / "run"
    job = [
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={run}",
        *PREEMPT_JOB,
        "metrics.enabled=true",
        "metrics.host=node",
        f"metrics.targets_dir={targets}",
        "metrics.linger_seconds=4",
        "metrics.job=two-nodes",
    ]
    with Nodes(2) as nodes:
        nodes.popen(
            0,
            [
                shutil.which("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                "--web.listen-address=127.0.0.1:9090",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def query(promql: str):
            done = subprocess.run(
                nodes.command(0, [sys.executable, "-c", PROMETHEUS_QUERY, promql]),
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout) if promql != "ready" else None

        query("ready")
        finished(torchrun_on_nodes(nodes, 1, job, tmp_path.name))
        time.sleep(1.5)  # the last scrape's samples become queryable
        listed = json.loads((targets / "targets.json").read_text())
        steps = query('max_over_time(vldist_steps_total{job="two-nodes"}[10m])')
    assert sorted((e["labels"]["rank"], e["labels"]["host"], e["targets"][0]) for e in listed) == [
        ("0", "node0", f"{nodes.addresses[0]}:9400"),
        ("1", "node1", f"{nodes.addresses[1]}:9400"),
    ]
    scraped = sorted((m["rank"], m["host"], m["instance"], value) for m, value in steps)
    assert scraped == [
        ("0", "node0", f"{nodes.addresses[0]}:9400", PREEMPT_STEPS),
        ("1", "node1", f"{nodes.addresses[1]}:9400", PREEMPT_STEPS),
    ], scraped


def test_hybrid_sharding_shards_within_a_node_and_replicates_across(one_process, tmp_path):
    """engine.backend=fsdp with engine.fsdp_shard_size=2 on 2 nodes x 2 ranks: each rank holds half
    of every parameter (not a quarter), the two ranks of a node hold different halves, and the
    same rank of the other node the same half; the step is one process's."""
    from fsdp_steps import __file__ as fsdp_worker

    out = tmp_path / "steps.pt"
    with Nodes(2) as nodes:
        finished(torchrun_on_nodes(nodes, 2, [fsdp_worker, str(out), "2"], tmp_path.name))
    many = torch.load(out, weights_only=True)
    assert many["mesh"] == (2, 2) and many["gather"]["world_size"] == 4
    assert all(abs(share - 0.5) < 0.01 for share in many["held"])
    node0_first, node0_second, node1_first, node1_second = many["slices"]
    assert torch.equal(node0_first, node1_first) and torch.equal(node0_second, node1_second)  # replicas across
    assert not torch.equal(node0_first[: len(node0_second)], node0_second)  # halves within a node
    worker.assert_same_step(many["gather"], one_process)
