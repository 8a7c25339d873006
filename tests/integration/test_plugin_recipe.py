"""A recipe from another package, through the ordinary commands and no change to vldist: the
package (tests/fixtures/meanpool_plugin, docs/adding-a-method.md) is installed without network into
a directory of its own, and with it on the path `python -m vldist.train meanpool` (its job, by name) trains and
evaluates, resumes, runs on 2 ranks, `--help` lists it and `python -m vldist.evaluate` reads its
run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TORCHRUN

PLUGIN = Path(__file__).resolve().parents[1] / "fixtures" / "meanpool_plugin"
JOB_FILE = PLUGIN / "vldist_meanpool" / "jobs" / "meanpool.yaml"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    """The environment of a process that has the plugin installed."""
    root = tmp_path_factory.mktemp("plugin")
    source, site = root / "source", root / "site"
    shutil.copytree(PLUGIN, source)
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert list(site.glob("vldist_meanpool-*.dist-info/entry_points.txt"))  # what vldist looks for
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def command(env: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def train(env: dict, planted_shards: Path, out: Path, *overrides: str, launcher=(sys.executable, "-m"), job="meanpool"):
    """The plugin's job, by its name (found through the plugin's vldist.jobs entry point)."""
    return command(
        env,
        *launcher,
        "vldist.train",
        job,
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        *overrides,
        cwd=out.parent,
    )


def test_a_plugin_recipe_trains_evaluates_resumes_and_runs_on_two_ranks(plugin, planted_shards, tmp_path):
    help_text = command(plugin, sys.executable, "-m", "vldist.train", "--help", cwd=tmp_path).stdout
    assert "meanpool" in help_text and "(a plugin)" in help_text and "vsrn" in help_text
    listed = next(line for line in help_text.splitlines() if line.startswith("job files"))
    assert "meanpool" in listed.split(": ", 1)[1].split(", ") and "vsrn" in listed  # the plugin's job file too

    run = tmp_path / "run"
    done = train(plugin, planted_shards, run, "train.epochs=1")
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads((run / "metrics.json").read_text())
    assert first["recipe"] == "meanpool" and first["steps"] == 7  # 200 samples / 32
    # it learns: the planted regions name the caption's words
    assert first["test"]["full"]["rsum"] > 3 * first["test"]["chance"]["rsum"], first["test"]

    resumed = train(plugin, planted_shards, run, "train.epochs=2", "train.resume=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 7" in resumed.stderr
    assert json.loads((run / "metrics.json").read_text())["steps"] == 14

    evaluated = command(plugin, sys.executable, "-m", "vldist.evaluate", str(run), "--json", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "meanpool checkpoint" in evaluated.stdout and "rsum" in evaluated.stdout
    # the run's best checkpoint, evaluated again, gives the test numbers training recorded
    again = json.loads(evaluated.stdout[evaluated.stdout.index("\n{") + 1 :])
    trained = json.loads((run / "metrics.json").read_text())["test"]
    assert again["full"] == trained["full"] and again["n_captions"] == trained["n_captions"] == 300

    two = tmp_path / "two_ranks"
    # compared after every step: both ranks end with the same parameters
    ranks = train(
        plugin, planted_shards, two, "train.epochs=1", "train.replica_check_every=1", launcher=(*TORCHRUN, "-m")
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert json.loads((two / "metrics.json").read_text())["world_size"] == 2
    assert "replica check at step 1: the 2 ranks hold the same 3 parameters and buffers" in ranks.stdout + ranks.stderr


def test_a_plugin_whose_loss_skips_the_engines_wrapper_is_stopped_after_its_first_update(
    plugin, planted_shards, tmp_path
):
    """Its ranks train apart (no gradient all-reduce): the replica check stops every rank at step 1,
    exit 4, naming the first parameter that differs and which rank holds which value."""
    run = tmp_path / "run"
    ranks = train(plugin, planted_shards, run, "recipe=meanpool_unsynced", "train.epochs=1", launcher=(*TORCHRUN, "-m"))
    assert ranks.returncode != 0
    assert (
        "error: the ranks' replicas of the model diverged by step 1: parameter image.weight differs (2 values: "
        "rank 0; rank 1; 3 of 3 checked tensors differ); this is the process's first check."
    ) in ranks.stderr, ranks.stderr[-3000:]
    assert "an override of Recipe.training_losses that calls the module itself" in ranks.stderr
    assert ranks.stderr.count("exitcode  : 4") + ranks.stderr.count("exitcode: 4") >= 1, ranks.stderr[-3000:]
    assert not list((run / "checkpoints").glob("step-*"))  # nothing of the diverged run was kept


def test_without_the_plugin_the_job_names_the_recipes_it_knows(planted_shards, tmp_path):
    missing = train(dict(os.environ), planted_shards, tmp_path / "run", job=str(JOB_FILE))
    assert missing.returncode == 2
    assert "unknown recipe 'meanpool'" in missing.stderr and "vsrn" in missing.stderr
    assert "Traceback" not in missing.stderr
