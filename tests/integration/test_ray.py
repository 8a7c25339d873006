"""`ray job submit -- python -m vldist.train vsrn` against a real local Ray head on loopback.

The head runs in its own session with its own temp dir and free ports, and is stopped by killing
that session (not `ray stop`, which would also stop any other Ray on the machine).
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import (
    PREEMPT_EPOCH_STEPS,
    PREEMPT_JOB,
    SMALL_EMBEDDED_SETS,
    free_port,
    free_port_pair,
    stop_event,
    wait_for_step,
)

from vldist.checkpoint.format import verify

pytest.importorskip("ray")

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
REPO = Path(__file__).resolve().parents[2]  # the checkout, shipped with --working-dir as a user would
JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "eval.baseline=false",
    "engine.sync_batchnorm=true",
    "data.workers=1",
    "ray.num_workers=2",
    "ray.max_failures=2",
]


@pytest.fixture(scope="module", autouse=True)
def ray_token(tmp_path_factory):
    """This head's own token, for it and every client: token authentication on, and independent of
    a ~/.ray/auth_token left by other Ray use (with one, a head turns authentication on while
    clients without RAY_AUTH_MODE=token send no token)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "token")
    patch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def ray_temp() -> Path:
    """The head's Ray directory (where it unpacks a job's --working-dir); removed with the head."""
    return Path(tempfile.mkdtemp(prefix="vr", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes


@pytest.fixture(scope="module")
def ray_head(ray_token, ray_temp):
    temp = ray_temp
    port, dashboard = free_port(), free_port()
    head = subprocess.Popen(
        [
            *RAY,
            "start",
            "--head",
            "--block",
            "--num-cpus",
            "2",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard),
            "--temp-dir",
            str(temp),
            "--disable-usage-stats",
        ],
        # the jobs' embedded sets, where one is built, are small ones (same code and format)
        env={**os.environ, "PYTHONPATH": SMALL_EMBEDDED_SETS, "VLDIST_DATA_HOME": str(temp / "data")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_dashboard(address, head)
        _wait_for_job_agent(address)
        yield address
    finally:
        _stop_head(head, temp)


def _wait_for_dashboard(address: str, head: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers: 401 when Ray's token authentication is on (~/.ray/auth_token exists)
        except OSError:
            assert head.poll() is None, "the Ray head exited while starting"
            assert time.time() < deadline, "the Ray head did not come up in 120 s"
            time.sleep(0.5)


def _wait_for_job_agent(address: str) -> None:
    """The dashboard answers some seconds before the node's job agent does; until then a submit
    fails with "No available agent to submit job, please try again later". A probe job accepted
    (--no-wait: its end is not waited for) says it answers."""
    deadline = time.time() + 120
    while True:
        probe = subprocess.run(
            [*RAY, "job", "submit", "--address", address, "--no-wait", "--", sys.executable, "-c", "pass"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode == 0:
            return
        assert "No available agent" in probe.stderr + probe.stdout, (probe.stdout + probe.stderr)[-3000:]
        assert time.time() < deadline, "the Ray head's job agent did not come up in 120 s"
        time.sleep(1)


def _stop_head(head: subprocess.Popen, temp: Path) -> None:
    """Kill this head's processes only: those started with our temp dir on their command line
    (GCS, raylet, dashboard, ...), and their children. Actors exit once their raylet is gone."""
    import psutil

    os.killpg(head.pid, signal.SIGTERM)
    doomed = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp) in arg for arg in proc.info["cmdline"] or []):
                doomed.update({p.pid: p for p in [proc, *proc.children(recursive=True)]})
        except psutil.Error:
            pass
    for proc in doomed.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(doomed.values()), timeout=30)
    head.wait(timeout=30)
    shutil.rmtree(temp, ignore_errors=True)


def _submit(address, *args, wait=True, job="vsrn", working_dir=None):
    options = ["--working-dir", str(working_dir)] if working_dir else []
    cmd = [
        *RAY,
        "job",
        "submit",
        "--address",
        address,
        *options,
        "--",
        sys.executable,
        "-m",
        "vldist.train",
        job,
        *args,
    ]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_two_stage_job_runs_each_stage_on_the_workers_in_its_own_directory(ray_head, planted_shards, tmp_path):
    """cl_caption: the MLE captioner stage, then CL from its best checkpoint, both as Ray Train runs."""
    pytest.importorskip("pycocoevalcap")
    if shutil.which("java") is None:
        pytest.skip("pycocoevalcap needs Java")
    data = {"batch_size": 20, "eval_batch_size": 30, "shuffle_buffer": 50, "max_regions": 3, "vocab_min_count": 1}
    sizes = {"hidden": 32, "embed": 16}
    captioner_job = tmp_path / "tiny_captioner.yaml"
    captioner_job.write_text(
        json.dumps(
            {
                "recipe": "captioner",
                "data": data,
                "model": sizes,  # JSON is YAML
                "train": {"epochs": 1, "lr": 0.005},
                "eval": {"self_retrieval_pool": 30, "baseline": False, "meteor": False},
            }
        )
    )
    proc = _submit(
        ray_head,
        f"data.shards={planted_shards}",
        f"ray.storage_path={tmp_path}",
        "ray.num_workers=2",
        f"model.captioner_job={captioner_job}",
        *(f"data.{k}={v}" for k, v in data.items()),
        *(f"model.{k}={v}" for k, v in sizes.items()),
        "train.max_steps=2",
        "eval.self_retrieval_pool=30",
        "eval.meteor=false",  # METEOR's JVM start on each stage's rank 0; scored in test_captioner_train
        "metrics.enabled=false",
        "data.workers=1",
        job="cl_caption",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    run = tmp_path / "cl_caption"
    mle, cl = (json.loads((run / stage / "metrics.json").read_text()) for stage in ("mle", "cl"))
    assert (mle["recipe"], mle["world_size"]) == ("captioner", 2) and (cl["recipe"], cl["world_size"]) == (
        "cl_caption",
        2,
    )
    assert cl["steps"] == 2
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["untrained"], ["mle"], ["cl"])]
    assert rows == ["mle", "cl"], out[-4000:]  # the MLE stage's result is CL's baseline


def test_a_two_branch_job_localises_phrases_on_the_workers(ray_head, tmp_path):
    """Phrase localisation, the task only this recipe has (its per-task stages are tested without Ray)."""
    from vldist.shards.synthetic.synth import build_synth

    shards = build_synth(tmp_path / "synth", n_train=80, n_val=16, n_test=24, feature_size=32, progress=False)
    assert shards["features"]["proposals"]
    proc = _submit(
        ray_head,
        f"data.shards={tmp_path / 'synth'}",
        f"ray.storage_path={tmp_path}",
        "ray.num_workers=2",
        "model.hidden=32",
        "model.embed=16",
        "data.batch_size=20",
        "data.eval_batch_size=24",
        "data.shuffle_buffer=50",
        "train.epochs=1",
        "metrics.enabled=false",
        "data.workers=1",
        "engine.sync_batchnorm=true",
        "model.tasks=[phrases]",
        job="two_branch_embed",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    metrics = json.loads((tmp_path / "two_branch_embed" / "metrics.json").read_text())  # one task: no stage directory
    assert metrics["world_size"] == 2 and metrics["config"]["model"]["tasks"] == ["phrases"]
    assert "phrase localisation:" in out


@pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java")
def test_an_l2c_job_builds_both_embedded_sets_in_the_nodes_data_home(ray_head, ray_temp, tmp_path):
    """`ray job submit --working-dir . -- python -m vldist.train l2c` with its two embedded sets
    (the pairs and the single-image captions): the workers build both in the head's data home (the
    VLDIST_DATA_HOME of its `ray start`), not in the checkout Ray unpacked (small ones: the head's
    sitecustomize), and each stream reads its own."""
    proc = _submit(
        ray_head,
        f"ray.storage_path={tmp_path}",
        "ray.num_workers=2",
        "model.image_size=64",
        "model.graph_dim=32",
        "model.hidden=32",
        "model.embed=16",
        "model.classes=3",
        "model.gcn_kernel=torch",
        "data.batch_size=8",
        "model.single_batch_size=8",
        "data.eval_batch_size=16",
        "data.shuffle_buffer=32",
        "data.workers=1",
        "train.epochs=1",
        "train.validate_every=0",
        "model.baseline_stage=false",
        "eval.beam_size=1",
        "eval.meteor=false",
        "metrics.enabled=false",
        job="l2c",
        working_dir=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    metrics = json.loads((tmp_path / "l2c" / "metrics.json").read_text())
    # 64 pairs / 8 = 8 pair steps and as many single-image steps, over a group of two workers
    assert metrics["world_size"] == 2 and metrics["steps"] == 16
    assert (metrics["config"]["data"]["shards"], metrics["config"]["model"]["single_shards"]) == (
        "shards/synth_pairs",
        "shards/synth",
    )
    data = ray_temp / "data"  # the head's VLDIST_DATA_HOME
    assert (data / "synth" / "manifest.json").is_file() and sorted(p.name for p in data.iterdir()) == [
        "synth",
        "synth_pairs",
    ]
    assert json.loads((data / "synth_pairs" / "manifest.json").read_text())["splits"]["train"]["samples"] == 64
    unpacked = [p.parent for p in ray_temp.glob("session_2*/runtime_resources/working_dir_files/_ray_pkg_*/jobs")]
    assert len(unpacked) == 1 and not (unpacked[0] / "shards" / "synth").exists(), unpacked
    assert "ROUGE-L" in out and "16 pairs" in out


@pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java")
def test_a_laviter_job_trains_every_module_on_two_workers(ray_head, scene_splits, tmp_path):
    """Phase 3 alone (every module: DAMSM, TIM's GAN and ITM). A job's stages one after another
    under Ray: the cl_caption test above; LAViTeR's phases from one another: test_laviter_train.py."""
    from test_laviter_train import TINY

    proc = _submit(
        ray_head,
        f"data.shards={scene_splits}",
        f"ray.storage_path={tmp_path}",
        "ray.num_workers=2",
        "model.pretrain_epochs=0",
        "model.vta_epochs=0",
        "model.assist_epochs=0",
        "model.joint_epochs=1",
        "train.max_steps=2",
        "eval.baseline=false",
        "eval.meteor=false",
        *TINY,
        job="laviter",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    metrics = json.loads((tmp_path / "laviter" / "metrics.json").read_text())  # one phase: no phase directory
    assert metrics["world_size"] == 2 and metrics["steps"] == 2 and metrics["config"]["model"]["phase"] == "joint"
    assert "R-prec@1" in out and "AIMCoS" in out


def test_a_bad_config_fails_fast_with_the_config_error(ray_head, tmp_path):
    started = time.time()
    proc = _submit(ray_head, f"ray.storage_path={tmp_path}", "train.lrr=0.1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "failed" in out.lower()
    assert "unknown key 'train.lrr'. Did you mean 'train.lr'?" in out
    assert "Traceback" not in out
    assert time.time() - started < 60
    assert not (tmp_path / "vsrn").exists()  # no worker started


def test_ray_job_stop_checkpoints_and_the_same_job_submitted_again_resumes(ray_head, planted_shards, tmp_path):
    epochs = 6  # 150 steps, about 16 s: the stop arrives long before the end
    job = [
        f"data.shards={planted_shards}",
        f"ray.storage_path={tmp_path}",
        *JOB,
        *PREEMPT_JOB,
        f"train.epochs={epochs}",
    ]
    # Ray kills the driver RAY_JOB_STOP_WAIT_TIME_S after `ray job stop` (3 s by default): give the
    # workers the time a step and a checkpoint take, as docs/preemption.md tells users to.
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    submit = subprocess.run(
        [
            *RAY,
            "job",
            "submit",
            "--address",
            ray_head,
            "--no-wait",
            "--runtime-env-json",
            runtime_env,
            "--",
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            *job,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
    run = tmp_path / "vsrn"
    wait_for_step(run, 5)
    # what `ray job stop` calls, from this process: the CLI's own start (it imports Ray) took long
    # enough on a loaded machine for the job to finish first
    from ray.job_submission import JobStatus, JobSubmissionClient

    # the head's token by hand: Ray read RAY_AUTH_MODE when this process imported it, before ray_token set it
    client = JobSubmissionClient(ray_head, headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
    assert client.stop_job(job_id)
    deadline = time.time() + 120
    while not client.get_job_status(job_id).is_terminal():
        assert time.time() < deadline, "the job did not stop within 120 s"
        time.sleep(0.5)
    assert client.get_job_status(job_id) == JobStatus.STOPPED
    logs = client.get_job_logs(job_id)
    assert "asking the workers to checkpoint and stop" in logs and "stopped by SIGTERM" in logs, logs[-4000:]
    step = stop_event(run)["step"]  # where the workers were when the stop reached them
    assert 5 <= step < epochs * PREEMPT_EPOCH_STEPS
    verify(run / "checkpoints" / f"step-{step:08d}")
    # rank 0 told the driver through the board (no file): the job's last words name the step
    assert f"after step {step}; checkpoint {run / 'checkpoints' / f'step-{step:08d}'}" in logs, logs[-4000:]

    other = _submit(ray_head, *job, "train.lr=0.0005")  # another job into the same run directory
    said = other.stdout + other.stderr
    assert (
        other.returncode != 0
        and (
            f"error: the Ray run directory {run} holds a run, with other settings than "
            "this job (1 differ: train.lr: the run's 0.001, this job's 0.0005)"
        )
        in said
    ), said[-3000:]
    assert "ray.name=vsrn-2" in said and "Traceback" not in said and "world_rank=" not in said

    again = _submit(ray_head, *job, "ray.num_workers=1")  # the same job (on fewer workers), submitted again
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "succeeded" in out, out[-4000:]
    checkpoint = run / "checkpoints" / f"step-{step:08d}"
    assert f"Ray run directory {run}: resuming the stopped run from step {step} ({checkpoint})" in out
    assert f"resumed from {checkpoint}" in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == epochs * PREEMPT_EPOCH_STEPS and metrics["restarts"] == 1 and metrics["world_size"] == 1


def test_a_rank_drifting_under_ray_stops_every_worker_with_the_check_and_no_restart(ray_head, planted_shards, tmp_path):
    """Rank 1's model is changed after step 2 (the Ray processes' sitecustomize does it, asked by
    the job's environment): the check at step 4 stops the run as under torchrun, and Ray does not
    restart it from a checkpoint that may hold the diverging copy."""
    job = [
        f"data.shards={planted_shards}",
        f"ray.storage_path={tmp_path}",
        *JOB,
        *PREEMPT_JOB,
        "train.epochs=1",
        "train.replica_check_every=4",
        "train.save_every_steps=2",
    ]
    runtime_env = json.dumps({"env_vars": {"VLDIST_TEST_DRIFT_AFTER_STEP": "2"}})
    proc = subprocess.run(
        [
            *RAY,
            "job",
            "submit",
            "--address",
            ray_head,
            "--runtime-env-json",
            runtime_env,
            "--",
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            *job,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "drifted: " in out, out[-4000:]
    assert "error: the ranks' replicas of the model diverged by step 4: parameter " in out, out[-4000:]
    assert "(2 values: rank 0; rank 1; " in out and "they agreed at step 1" in out
    assert "resuming from the newest in the run directory" not in out  # no restart
    assert sorted(p.name for p in (tmp_path / "vsrn" / "checkpoints").glob("step-*")) == ["step-00000002"]


def test_a_job_reads_its_shards_from_s3_on_the_workers(ray_head, s3_store, planted_shards, tmp_path):
    """The job a user submits, its shards in S3: two workers train, and the driver writes the results
    (a worker lost mid-run, on a node of its own: tests/integration/test_multinode.py)."""
    fs = s3_store.filesystem()
    if not fs.exists("vldist-tests"):
        fs.mkdir("vldist-tests")
    fs.put(str(planted_shards), "vldist-tests/ray-planted", recursive=True)
    # the credentials as the job's environment (a cluster would set them on its nodes: cluster/ray/README.md)
    runtime_env = json.dumps({"env_vars": s3_store.environment})
    proc = subprocess.run(
        [
            *RAY,
            "job",
            "submit",
            "--address",
            ray_head,
            "--runtime-env-json",
            runtime_env,
            "--",
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            "data.shards=s3://vldist-tests/ray-planted",
            f"ray.storage_path={tmp_path}",
            "train.epochs=2",
            f"metrics.port={free_port_pair()}",
            *JOB,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    assert "world_rank=1" in out  # a group of two workers, as the job asked
    run = tmp_path / "vsrn"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 14 and metrics["restarts"] == 0
    assert metrics["config"]["data"]["shards"] == "s3://vldist-tests/ray-planted"  # not made a local path
    assert (run / "checkpoints" / "best" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step-00000014" / "COMPLETE").is_file()
    assert "trained " in out  # the driver printed the results table
    targets = json.loads((run / "prometheus" / "targets.json").read_text())  # for Prometheus file_sd, by rank 0
    assert sorted(t["labels"]["rank"] for t in targets) == ["0", "1"]
