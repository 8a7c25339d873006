"""cluster/slurm/train.sbatch on a real Slurm cluster: on two nodes (tests/netns.py), a task on
each, the time-limit warning checkpoints, requeues and resumes the job, and a node lost mid-run
requeues it and it resumes once the node is back; on one node, the shards from S3."""

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import (  # noqa: E402
    PREEMPT_EPOCH_STEPS,
    PREEMPT_JOB,
    PREEMPT_STEPS,
    assert_same_weights,
    stop_event,
    wait_for_step,
    weights,
)
from netns import Nodes  # noqa: E402
from netns import unavailable as no_nodes  # noqa: E402
from slurm_cluster import available, slurm_cluster  # noqa: E402

from vldist.checkpoint.format import step_checkpoints  # noqa: E402
from vldist.launch.environment import adopt_slurm_environment  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_srun_tasks_are_mapped_and_the_batch_step_is_not():
    step = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_NODELIST": "127.0.0.1",
    }
    assert adopt_slurm_environment(step)
    assert (step["RANK"], step["WORLD_SIZE"], step["LOCAL_RANK"], step["MASTER_PORT"]) == ("1", "2", "1", "20042")
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert not adopt_slurm_environment(batch_script) and "RANK" not in batch_script
    under_torchrun = {"RANK": "0", "WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert not adopt_slurm_environment(under_torchrun) and under_torchrun["WORLD_SIZE"] == "4"


ONE_TASK_PER_NODE = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
needs_nodes = pytest.mark.skipif(
    available() is not None or no_nodes() is not None, reason=str(available() or no_nodes())
)


@contextmanager
def two_node_cluster(root: Path):
    with Nodes(2) as nodes, slurm_cluster(root, nodes) as cluster:
        yield cluster


def submit(
    cluster, tmp_path: Path, out: Path, options: list[str], args: list[str], env: dict | None = None, export: str = ""
) -> str:
    """train.sbatch for vsrn (the tasks' MASTER_ADDR: the script's default, the first node's name,
    unless `export` sets it), its log in tmp_path; returns the job id."""
    sbatch = cluster.run(
        [
            "sbatch",
            "--parsable",
            *options,
            f"--output={tmp_path}/slurm-%j.out",
            f"--chdir={REPO}",
            f"--export=ALL,PYTHON={sys.executable}{export}",
            str(REPO / "cluster/slurm/train.sbatch"),
            "vsrn",
            f"output.dir={out}",
            *args,
        ],
        env=env,
        timeout=30,
    )
    assert sbatch.returncode == 0, sbatch.stderr
    return sbatch.stdout.strip().split(";")[0]


def wait_for_state(cluster, job_id: str, wanted: str, timeout: float = 300, also: str = "") -> str:
    """Until the job's state shows `wanted` (and `also`); fails at a state it cannot leave."""
    deadline = time.time() + timeout
    while wanted not in (state := cluster.job(job_id)) or also not in state:
        assert "JobState=FAILED" not in state and "JobState=CANCELLED" not in state, state
        assert time.time() < deadline, f"no {wanted} {also} after {timeout} s: {state}"
        time.sleep(0.5)
    return state


@needs_nodes
def test_a_two_node_job_survives_its_time_limit_and_a_lost_node_and_ends_as_if_uninterrupted(
    planted_shards, tmp_path, two_rank_reference
):
    """train.sbatch on two nodes, a rank on each. First the time-limit warning (--signal=B:USR1)
    reaches the batch script on node 0, which forwards it to both ranks: they checkpoint the step
    reached mid-epoch and the script requeues the job. The second start resumes from it; after the
    epoch's checkpoint, node 1 loses every process (its slurmd and its rank): Slurm sets it DOWN
    and requeues the job, and once node 1's slurmd is back the third start resumes from that
    checkpoint. The run ends with the weights of an uninterrupted 2-rank run."""
    out = tmp_path / "run"
    with two_node_cluster(tmp_path / "slurm") as cluster:
        job_id = submit(cluster, tmp_path, out, ONE_TASK_PER_NODE, [f"data.shards={planted_shards}", *PREEMPT_JOB])
        wait_for_step(out, 5)
        # What the time-limit warning does (--signal=B:USR1@N): USR1 to the batch script alone.
        assert cluster.run(["scancel", "--batch", "--signal=USR1", job_id], timeout=30).returncode == 0
        wait_for_state(cluster, job_id, "JobState=PENDING", also="Restarts=1")
        stopped_at = stop_event(out)["step"]
        assert 5 <= stopped_at < PREEMPT_EPOCH_STEPS  # mid-epoch, where no periodic checkpoint falls
        assert [p.name for p in step_checkpoints(out / "checkpoints")] == [f"step-{stopped_at:08d}"]

        # Slurm starts it again once the first run's credentials expired (AuthInfo=cred_expire)
        wait_for_step(out, PREEMPT_EPOCH_STEPS + 2)  # past the end of epoch 1 and its checkpoint
        cluster.nodes.power_off(1)
        wait_for_state(cluster, job_id, "Restarts=2")
        cluster.start_slurmd(1)
        wait_for_state(cluster, job_id, "JobState=COMPLETED")
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "time limit near" in log and log.count("SIGUSR1 received") == 2  # a rank on each node
    assert f"requeueing job {job_id}" in log and "start 2 on node0" in log and "start 3 on node0" in log
    checkpoints = out / "checkpoints"
    assert f"resumed from {checkpoints / f'step-{stopped_at:08d}'}" in log
    assert f"resumed from {checkpoints / f'step-{PREEMPT_EPOCH_STEPS:08d}'}" in log
    # the rank on node 0 says in one line what happened (no traceback from inside DDP)
    lost = [line for line in log.splitlines() if "lost another rank" in line]  # gloo's words vary: reset, closed
    assert (
        lost
        and lost[0].startswith("error: rank 0 on node0 lost another rank of the run (")
        and "[198.18.0.2]" in lost[0]
    ), log[-3000:]
    assert "Traceback" not in log and "terminate called" not in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 2
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(out / "checkpoints" / final), weights(two_rank_reference / "checkpoints" / final))


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_job_reads_its_shards_from_s3_on_two_tasks(s3_store, planted_shards, tmp_path, two_rank_reference):
    """train.sbatch with data.shards=s3://...: the credentials in the job's environment (srun hands
    them to every task), the run equal to the same 2-rank job from local disk."""
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(planted_shards), "vldist-tests/slurm-planted", recursive=True)
    out = tmp_path / "run"
    with slurm_cluster(tmp_path / "slurm") as cluster:
        job_id = submit(
            cluster,
            tmp_path,
            out,
            ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
            ["data.shards=s3://vldist-tests/slurm-planted", *PREEMPT_JOB],
            env={**cluster.env, **s3_store.environment},  # --export=ALL: the AWS_* variables too
            export=",MASTER_ADDR=127.0.0.1",
        )
        wait_for_state(cluster, job_id, "JobState=COMPLETED")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["config"]["data"]["shards"] == "s3://vldist-tests/slurm-planted"
    assert metrics["test"] == json.loads((two_rank_reference / "metrics.json").read_text())["test"]
