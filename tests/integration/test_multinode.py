"""Runs across hosts, on "nodes" made of network namespaces on this machine (tests/netns.py:
their own hostnames and /etc/hosts, addresses in 198.18.0.0/15 that exist only inside them).

torchrun on two nodes, its c10d rendezvous on the first, takes the same training step as one
process on the whole batch (the cross-rank negatives gathered across hosts), also when each node's
/etc/hosts maps its own name to 127.0.1.1 as Debian writes it: gloo would then tell the other
node to connect to 127.0.1.1, and vldist picks the interface towards MASTER_ADDR instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import equivalence_step as worker  # noqa: E402
from engines import cpu_engine  # noqa: E402
from netns import Nodes, unavailable  # noqa: E402

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
    from helpers import SMALL_VSRN

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
