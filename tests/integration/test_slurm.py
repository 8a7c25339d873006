"""cluster/slurm/train.sbatch on a real one-node Slurm cluster: 2 srun tasks form one process group,
and the time-limit warning checkpoints, requeues and resumes the job."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import (  # noqa: E402
    PREEMPT_EPOCH_STEPS, PREEMPT_JOB, PREEMPT_STEPS, assert_same_weights, stop_event, wait_for_step, weights,
)
from slurm_cluster import available, slurm_cluster  # noqa: E402

from vldist.checkpoint import step_checkpoints  # noqa: E402
from vldist.launch.environment import adopt_slurm_environment  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_srun_tasks_are_mapped_and_the_batch_step_is_not():
    step = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42",
            "SLURM_STEP_NODELIST": "127.0.0.1"}
    assert adopt_slurm_environment(step)
    assert (step["RANK"], step["WORLD_SIZE"], step["LOCAL_RANK"], step["MASTER_PORT"]) == ("1", "2", "1", "20042")
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert not adopt_slurm_environment(batch_script) and "RANK" not in batch_script
    under_torchrun = {"RANK": "0", "WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert not adopt_slurm_environment(under_torchrun) and under_torchrun["WORLD_SIZE"] == "4"


def _job(env, job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_time_limit_warning_checkpoints_requeues_and_the_requeued_job_resumes(planted_shards, tmp_path,
                                                                               two_rank_reference):
    """The job's --signal=B:USR1 warning reaches the batch script, which forwards it to the 2 srun
    ranks; they checkpoint the step reached and the script requeues the job, which resumes from it
    and ends with the weights of an uninterrupted 2-rank run."""
    out = tmp_path / "run"
    with slurm_cluster(tmp_path / "slurm") as env:
        submit = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
             f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}",
             "--export=ALL,MASTER_ADDR=127.0.0.1,PYTHON=" + sys.executable,
             str(REPO / "cluster/slurm/train.sbatch"), "vsrn", f"data.shards={planted_shards}", f"output.dir={out}",
             *PREEMPT_JOB],
            env=env, capture_output=True, text=True, timeout=30,
        )
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        wait_for_step(out, 5)
        # What the time-limit warning does (--signal=B:USR1@N): USR1 to the batch script alone.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=30)
        deadline = time.time() + 300
        while "Restarts=1" not in (state := _job(env, job_id)) or "JobState=PENDING" not in state:
            assert "JobState=COMPLETED" not in state and "JobState=FAILED" not in state, state
            assert time.time() < deadline, "the job was not requeued"
            time.sleep(0.5)
        stopped_at = stop_event(out)["step"]
        assert [p.name for p in step_checkpoints(out / "checkpoints")] == [f"step-{stopped_at:08d}"]
        # Slurm starts it again once the first run's credentials expired (AuthInfo=cred_expire)
        while "JobState=COMPLETED" not in (state := _job(env, job_id)):
            assert "JobState=FAILED" not in state and "JobState=CANCELLED" not in state, state
            assert time.time() < deadline, "the requeued job did not finish"
            time.sleep(0.5)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "time limit near" in log and log.count("SIGUSR1 received") == 2
    assert f"requeueing job {job_id}" in log and "start 2 on" in log
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:08d}'}" in log
    assert 5 <= stopped_at < PREEMPT_EPOCH_STEPS  # mid-epoch, where no periodic checkpoint falls
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == PREEMPT_STEPS and metrics["restarts"] == 1
    final = f"step-{PREEMPT_STEPS:08d}"
    assert_same_weights(weights(out / "checkpoints" / final), weights(two_rank_reference / "checkpoints" / final))
    assert "terminate called" not in log


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_job_reads_its_shards_from_s3_on_two_tasks(s3_store, planted_shards, tmp_path, two_rank_reference):
    """train.sbatch with data.shards=s3://...: the credentials in the job's environment (srun hands
    them to every task), the run equal to the same 2-rank job from local disk."""
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(planted_shards), "vldist-tests/slurm-planted", recursive=True)
    out = tmp_path / "run"
    with slurm_cluster(tmp_path / "slurm") as env:
        submit = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
             f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}",
             "--export=ALL,MASTER_ADDR=127.0.0.1,PYTHON=" + sys.executable,  # ALL: the AWS_* variables too
             str(REPO / "cluster/slurm/train.sbatch"), "vsrn", "data.shards=s3://vldist-tests/slurm-planted",
             f"output.dir={out}", *PREEMPT_JOB],
            env={**env, **s3_store.environment}, capture_output=True, text=True, timeout=30,
        )
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        deadline = time.time() + 300
        while "JobState=COMPLETED" not in (state := _job(env, job_id)):
            assert "JobState=FAILED" not in state and "JobState=CANCELLED" not in state, \
                state + (tmp_path / f"slurm-{job_id}.out").read_text()[-3000:]
            assert time.time() < deadline, "the job did not finish"
            time.sleep(0.5)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["config"]["data"]["shards"] == "s3://vldist-tests/slurm-planted"
    assert metrics["test"] == json.loads((two_rank_reference / "metrics.json").read_text())["test"]
