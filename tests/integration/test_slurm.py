"""cluster/slurm/train.sbatch on a real one-node Slurm cluster: 2 srun tasks form one process group."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import available, slurm_cluster  # noqa: E402

from vldist.distributed.launch_env import adopt_slurm_environment  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
JOB = ["model.embed_size=64", "model.decoder_hidden=64", "model.word_dim=32", "data.batch_size=32",
       "data.shuffle_buffer=100", "data.eval_batch_size=64", "train.epochs=3", "engine.sync_batchnorm=true"]


def test_srun_tasks_are_mapped_and_the_batch_step_is_not():
    step = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42",
            "SLURM_STEP_NODELIST": "127.0.0.1"}
    assert adopt_slurm_environment(step)
    assert (step["RANK"], step["WORLD_SIZE"], step["LOCAL_RANK"], step["MASTER_PORT"]) == ("1", "2", "1", "20042")
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert not adopt_slurm_environment(batch_script) and "RANK" not in batch_script
    under_torchrun = {"RANK": "0", "WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert not adopt_slurm_environment(under_torchrun) and under_torchrun["WORLD_SIZE"] == "4"


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_sbatch_job_trains_on_two_ranks(planted_shards, tmp_path):
    out = tmp_path / "run"
    with slurm_cluster(tmp_path / "slurm") as env:
        submit = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
             f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO}",
             "--export=ALL,MASTER_ADDR=127.0.0.1,PYTHON=" + sys.executable,
             str(REPO / "cluster/slurm/train.sbatch"), "vsrn", f"data.shards={planted_shards}", f"output.dir={out}", *JOB],
            env=env, capture_output=True, text=True, timeout=30,
        )
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        deadline = time.time() + 400
        while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
            assert time.time() < deadline, "the Slurm job did not finish in time"
            time.sleep(1)
        state = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "JobState=COMPLETED" in state or (out / "metrics.json").exists(), log[-3000:]
    assert "ExitCode=0:0" in state, state + log[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["steps"] == 3 * 7  # what torchrun and one process take for this job
    assert "terminate called" not in log
