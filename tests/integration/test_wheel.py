"""The package runs without the checkout: a wheel installed into a fresh directory trains from an
unrelated working directory, with the built-in job files inside it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "eval.baseline=false",
    "metrics.enabled=false",
]


def _source_copy(dest: Path) -> Path:
    """The files a clone has (tracked, or new and not ignored), links kept as links."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    for name in filter(None, listed):
        source, target = REPO / name, dest / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


def test_an_installed_wheel_lists_its_jobs_and_trains_from_anywhere(planted_shards, tmp_path):
    source = _source_copy(tmp_path / "src")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("vldist-*.whl")
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the editable checkout on sys.path

    def python(*args):
        return subprocess.run(
            [sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )

    where = python(
        "-c",
        "import vldist, vldist.distributed.deepspeed_config as d; print(vldist.__file__); "
        "print(d.find_deepspeed_file('jobs/deepspeed/zero2.json'))",
    )
    assert where.returncode == 0, where.stderr
    package, zero2 = where.stdout.split()
    assert Path(package).is_relative_to(site) and Path(zero2).is_relative_to(site)  # not the checkout's
    help_text = python("-m", "vldist.train", "vsrn", "--help")
    assert help_text.returncode == 0, help_text.stderr
    shipped = ", ".join(sorted(p.stem for p in (Path(__file__).parents[2] / "jobs").glob("*.yaml")))
    assert f"job files (vldist's jobs/, the plugins' and ./jobs): {shipped}" in help_text.stdout
    assert "model.rrr_layers = 4" in help_text.stdout

    trained = python("-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", "train.max_steps=3", *SMALL)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "3 steps" in trained.stdout and (elsewhere / "runs" / "vsrn" / "metrics.json").is_file()
