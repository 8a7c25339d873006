"""Runs across hosts, on "nodes" made of network namespaces on this machine (tests/netns.py:
their own hostnames and /etc/hosts, addresses in 198.18.0.0/15 that exist only inside them).

- torchrun on two nodes, its c10d rendezvous on the first, takes the same training step as one
  process on the whole batch (the cross-rank negatives gathered across hosts), also when each
  node's /etc/hosts maps its own name to 127.0.1.1 as Debian writes it: gloo would then tell the
  other node to connect to 127.0.1.1, and vldist picks the interface towards MASTER_ADDR instead.
- A shard set on one node's disk only is reported with that node's name.
- A node lost mid-run and brought back, under torchrun and under Ray (a head and a worker node),
  ends the run with the weights of an uninterrupted one. (Slurm's: tests/integration/test_slurm.py.)"""

from __future__ import annotations

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
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import equivalence_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from helpers import PREEMPT_JOB, PREEMPT_STEPS, SMALL_VSRN, assert_same_weights, wait_for_step, weights  # noqa: E402
from netns import Nodes, unavailable  # noqa: E402

from vldist.distributed.watchdog import HUNG  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no test nodes: {unavailable()}")
RENDEZVOUS_PORT = 29400  # inside the first node's namespace: no other process can hold it


@pytest.fixture(scope="module")
def one_process():
    return worker.step(cpu_engine(), worker.make_recipe(gather=True))


def torchrun_command(nodes: Nodes, node: int, per_node: int, script: list[str], run_id: str) -> list[str]:
    """`torchrun --nnodes N --nproc-per-node per_node` for `node`, the rendezvous on node 0 (by
    address, and told it is the host: its own name may resolve to loopback)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes.count), "--nproc-per-node",
            str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.addresses[0]}:{RENDEZVOUS_PORT}",
            "--rdzv-id", run_id, *(["--rdzv-conf", "is_host=1"] if node == 0 else []), "--local-addr",
            nodes.addresses[node], *script]


def torchrun_on_nodes(nodes: Nodes, per_node: int, script: list[str], run_id: str,
                      hidden: dict[int, tuple] | None = None) -> list[subprocess.Popen]:
    """torchrun_command started on every node, its output captured; `hidden`: per node, the
    directories its disk lacks."""
    return [nodes.popen(i, torchrun_command(nodes, i, per_node, script, run_id), hidden=(hidden or {}).get(i, ()),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(nodes.count)]


def finished(processes: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """The outputs of every process, once each has exited 0 (else all of them in the failure)."""
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), \
        "\n\n".join(f"node {i}, exit {p.returncode}:\n{out[-3000:]}" for i, (p, out) in enumerate(zip(processes, outputs)))
    return outputs


@pytest.mark.parametrize("per_node, own_name_loopback", [(1, True), (2, False)],
                         ids=["1-rank-each-hostname-on-loopback", "2-ranks-each"])
def test_torchrun_on_two_nodes_takes_the_step_of_one_process(one_process, tmp_path, per_node, own_name_loopback):
    out = tmp_path / "step.pt"
    with Nodes(2, own_name_loopback=own_name_loopback) as nodes:
        finished(torchrun_on_nodes(nodes, per_node, [str(Path(worker.__file__)), str(out), "gather", "accelerate"],
                                   tmp_path.name))
    many = torch.load(out, weights_only=True)
    assert many["world_size"] == 2 * per_node
    worker.assert_same_step(many, one_process)



def test_a_shard_set_that_one_node_lacks_is_named_with_that_node(planted_shards, tmp_path):
    """The set on node 0's disk only (hidden on node 1): the job stops with the path and node 1's
    name, and what to do, instead of a rank failing somewhere in the data pipeline."""
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={tmp_path / 'run'}",
           "train.epochs=1", *SMALL_VSRN]
    with Nodes(2) as nodes:
        processes = torchrun_on_nodes(nodes, 1, job, tmp_path.name, hidden={1: (planted_shards.parent,)})
        outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert processes[0].returncode != 0 and processes[1].returncode != 0  # neither node trains alone
    said = "".join(outputs)  # rank 0, on either node, reports the error of the rank that met it
    assert f"error: shard directory '{planted_shards}' does not exist on node1" in said, \
        [line for line in said.splitlines() if "error" in line.lower()]
    assert "put it on a disk they share, on each node, or in object storage" in said


def test_the_embedded_default_is_built_on_every_node_that_lacks_it(tmp_path):
    """`python -m vldist.train vsrn` with the default data.shards (shards/synth, relative to where
    each node starts the job), on two nodes whose working directories are not one disk (node 1's
    is hidden: empty): each node's first rank builds the deterministic set, both train on the same
    bytes, and node 1's copy equals node 0's file for file. The builder is shrunk for the test
    (workers/small_embedded_set/sitecustomize.py); the path it takes is the real one."""
    work, run = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(worker.__file__).parent / "small_embedded_set")}
    job = ["-m", "vldist.train", "vsrn", f"output.dir={run}", "train.max_steps=2", "train.validate_every=0",
           *SMALL_VSRN, "data.batch_size=16", "data.eval_batch_size=16"]
    # in the working directory: its filesystem, the job, then the digests of the set it built there
    script = (f'cd {work} && echo "-- cwd: $(stat -f -c %T .)" && "$@" && echo "-- files:" && '
              'cd shards/synth && sha256sum -- * | sort -k2')
    with Nodes(2) as nodes:
        processes = [nodes.popen(i, ["sh", "-c", script, "sh", *torchrun_command(nodes, i, 1, job, tmp_path.name)],
                                 hidden=(work,) if i == 1 else (), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outputs = finished(processes)
    assert "-- cwd: tmpfs" in outputs[1] and "-- cwd: tmpfs" not in outputs[0]  # node 1 started on a disk of its own
    files = [out[out.rindex("-- files:"):] for out in outputs]
    assert files[0] == files[1] and "manifest.json" in files[0] and "train-000001.tar" in files[0], files
    assert "building the embedded synthetic dataset" in outputs[0]  # rank 0 says so; node 1's rank logs warnings only
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 2 and metrics["config"]["data"]["shards"] == "shards/synth"
    assert metrics["test"]["n_images"] == 16  # the shrunk set: the job read what the nodes built


def test_an_output_directory_one_node_does_not_share_is_refused_before_training(planted_shards, tmp_path):
    """Node 1 has a directory of its own at output.dir's path: the run stops at its start, naming
    rank 1's node and what to do, instead of writing checkpoints rank 0 never sees (or resuming
    rank 1 from nothing while rank 0 resumes)."""
    run = tmp_path / "run"
    run.mkdir()  # node 1's mount point
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={run}", "train.epochs=1",
           *SMALL_VSRN]
    with Nodes(2) as nodes:
        processes = torchrun_on_nodes(nodes, 1, job, tmp_path.name + "-out", hidden={1: (run,)})
        outputs = [process.communicate(timeout=240)[0] for process in processes]
    said = "".join(outputs)
    assert processes[0].returncode != 0 and processes[1].returncode != 0, said[-3000:]
    assert f"error: output.dir {run} is not one directory for every rank: rank 1 on node1 does not see" in said, \
        [line for line in said.splitlines() if "error" in line.lower()]
    assert "set output.checkpoint_dir to a store URL" in said
    assert not re.search(r'File ".*/vldist/', said)  # one line from each rank (torchrun prints its own traceback)
    assert not (run / "checkpoints").exists()  # nothing trained


def test_a_node_lost_mid_run_comes_back_and_the_run_ends_as_if_never_lost(planted_shards, tmp_path, two_rank_reference):
    """Node 1 loses every process mid-epoch (as a power failure would) and its torchrun is started
    again (as a scheduler would): node 0's agent restarts its rank (--max-restarts), both rejoin the
    rendezvous and resume from the last checkpoint on the disk they share (train.resume=auto); the
    run ends with the steps and weights of the uninterrupted 2-rank run."""
    run = tmp_path / "run"
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={run}", *PREEMPT_JOB,
           "train.save_every_steps=4", "train.resume=auto"]
    # torch >= 2.4 shares the rendezvous store with the ranks, and a surviving agent then never
    # publishes the new round's master address to a rejoining node (pytorch/pytorch#147064)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Nodes(2) as nodes:
        def start(node: int) -> subprocess.Popen:
            argv = torchrun_command(nodes, node, 1, job, tmp_path.name)
            argv[3:3] = ["--max-restarts", "3"]  # after `python -m torch.distributed.run`
            return nodes.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        first, second = start(0), start(1)
        wait_for_step(run, 9)
        nodes.power_off(1)
        lost_output = second.communicate(timeout=30)[0]
        second = start(1)
        outputs = finished([first, second], timeout=400)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 1, \
        (lost_output[-2000:], outputs[0][-3000:])
    resumed = re.search(r"resumed from \S+step-(\d+)", "".join(outputs))
    assert resumed and 8 <= int(resumed.group(1)) < PREEMPT_STEPS
    assert "error: rank 0 on node0 lost another rank of the run" in outputs[0]  # one line, then the restart
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(run / "checkpoints" / final), weights(two_rank_reference / "checkpoints" / final))


RAY = [sys.executable, "-m", "ray.scripts.scripts"]
def test_a_frozen_node_is_named_by_the_other_within_the_hang_timeout(planted_shards, tmp_path):
    """Every process of node 1 stopped (SIGSTOP: its connections stay open, nothing answers): the
    rank on node 0 exits HUNG within train.hang_timeout_s and a margin, naming rank 1 on node1."""
    run = tmp_path / "run"
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={run}", *PREEMPT_JOB,
           "train.epochs=20", "train.hang_timeout_s=8"]
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


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary (apt-get install prometheus)")
def test_prometheus_on_the_first_node_scrapes_every_rank_of_a_two_node_run(planted_shards, tmp_path):
    """metrics.host=node: each rank binds its node's address; rank 0 writes every rank's endpoint
    to one file_sd file; a real Prometheus on node 0, given only that file, scrapes both nodes."""
    targets, config = tmp_path / "targets", tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      "scrape_configs:\n  - job_name: vldist\n    honor_labels: true\n"
                      f"    file_sd_configs: [{{files: ['{targets}/*.json'], refresh_interval: 1s}}]\n")
    run = tmp_path / "run"
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={run}", *PREEMPT_JOB,
           "metrics.enabled=true", "metrics.host=node", f"metrics.targets_dir={targets}", "metrics.linger_seconds=4",
           "metrics.job=two-nodes"]
    with Nodes(2) as nodes:
        nodes.popen(0, [shutil.which("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        "--web.listen-address=127.0.0.1:9090"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def query(promql: str):
            done = subprocess.run(nodes.command(0, [sys.executable, "-c", PROMETHEUS_QUERY, promql]),
                                  capture_output=True, text=True, timeout=90)
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout) if promql != "ready" else None

        query("ready")
        finished(torchrun_on_nodes(nodes, 1, job, tmp_path.name))
        time.sleep(1.5)  # the last scrape's samples become queryable
        listed = json.loads((targets / "targets.json").read_text())
        steps = query('max_over_time(vldist_steps_total{job="two-nodes"}[10m])')
    assert sorted((e["labels"]["rank"], e["labels"]["host"], e["targets"][0]) for e in listed) == \
        [("0", "node0", f"{nodes.addresses[0]}:9400"), ("1", "node1", f"{nodes.addresses[1]}:9400")]
    scraped = sorted((m["rank"], m["host"], m["instance"], value) for m, value in steps)
    assert scraped == [("0", "node0", f"{nodes.addresses[0]}:9400", PREEMPT_STEPS),
                       ("1", "node1", f"{nodes.addresses[1]}:9400", PREEMPT_STEPS)], scraped


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
    role = (["--head", "--port", str(RAY_PORT), "--dashboard-host", "127.0.0.1", "--dashboard-port",
             str(DASHBOARD_PORT)] if node == 0 else ["--address", f"{nodes.addresses[0]}:{RAY_PORT}"])
    temps.append(tempfile.mkdtemp(prefix="vn", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    # A lost node is declared dead after 3 missed health checks a second apart (Ray's defaults: 5,
    # 3 s apart, each waiting up to 10 s): the tests wait that long after each power-off.
    checks = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
              "RAY_health_check_failure_threshold": "3"}
    return nodes.popen(node, [*RAY, "start", "--block", *role, "--num-cpus", "1", "--node-ip-address",
                              nodes.addresses[node], "--temp-dir", temps[-1], "--disable-usage-stats"],
                       hidden=hidden, env={**env, **checks}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_ray_nodes(nodes: Nodes, count: int, env: dict) -> None:
    subprocess.run(nodes.command(0, [sys.executable, "-c", WAIT_FOR_NODES, f"{nodes.addresses[0]}:{RAY_PORT}",
                                     str(count)]), env=env, check=True, timeout=180, capture_output=True)


def submit_on_head(nodes: Nodes, job: list[str], env: dict) -> subprocess.Popen:
    """`ray job submit` on node 0, once its job agent answers (some seconds after the dashboard)."""
    submit = [*RAY, "job", "submit", "--address", f"http://127.0.0.1:{DASHBOARD_PORT}", "--"]
    deadline = time.time() + 120
    while (probe := subprocess.run(nodes.command(0, [*submit, sys.executable, "-c", "pass"]), env=env,
                                   capture_output=True, text=True, timeout=120)).returncode != 0:
        assert "No available agent" in probe.stdout + probe.stderr, (probe.stdout + probe.stderr)[-3000:]
        assert time.time() < deadline, "the head's job agent did not come up in 120 s"
        time.sleep(1)
    return nodes.popen(0, [*submit, sys.executable, *job], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def on_node_0(nodes: Nodes, env: dict, code: str, *args: str) -> str:
    """Python `code` run on node 0 (where the nodes' S3 store answers); its stdout."""
    done = subprocess.run(nodes.command(0, [sys.executable, "-c", code, *args]), env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


STORE = "import os, s3fs; fs = s3fs.S3FileSystem(endpoint_url=os.environ['AWS_ENDPOINT_URL'])\n"


def nodes_store(nodes: Nodes, directory: Path, env: dict):
    """A SeaweedFS S3 store on node 0's address, which both nodes reach (and nothing else)."""
    from seaweed import start_s3_store

    def answers(store) -> bool:
        probe = subprocess.run(nodes.command(0, [sys.executable, "-c", STORE + "fs.ls('')"]),
                               env={**env, **store.environment}, capture_output=True, timeout=60)
        return probe.returncode == 0

    directory.mkdir()
    return start_s3_store(directory, ip=nodes.addresses[0], launch=lambda argv, **kw: nodes.popen(0, argv, **kw),
                          answers=answers)


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


def ray_run_losing_node_1(planted_shards, tmp_path, workers: str, rejoin: bool,
                          own_disks: bool = False) -> tuple[str, list[str]]:
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
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
    run_dir = tmp_path / "runs"
    run_dir.mkdir()  # a mount point, on node 1, where own_disks
    job = ["-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"ray.storage_path={run_dir}",
           f"ray.num_workers={workers}", "ray.max_failures=2", "train.save_every_steps=8", *PREEMPT_JOB]
    temps = []
    try:
        with Nodes(2) as nodes:
            if own_disks:
                store = nodes_store(nodes, tmp_path / "s3", env)
                env.update(store.environment)  # on the nodes, as a cluster sets them (cluster/ray/README.md)
                on_node_0(nodes, env, STORE + "fs.mkdir('vldist-tests'); fs.put(*__import__('sys').argv[1:], "
                          "recursive=True)", str(planted_shards), "vldist-tests/planted")
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
                on_node_0(nodes, env, STORE + "fs.get(*__import__('sys').argv[1:], recursive=True)",
                          f"vldist-tests/run/step-{PREEMPT_STEPS:08d}", str(tmp_path / "final"))
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    assert output.process.returncode == 0 and "succeeded" in out, out[-4000:]
    return out, list(nodes.addresses)


def test_ray_workers_on_two_nodes_with_their_own_disks_lose_one_and_resume_from_the_store(planted_shards, tmp_path,
                                                                                         two_rank_reference):
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
