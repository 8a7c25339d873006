"""Outputs that cannot be written (docs/bad-input.md): `output.dir` on a read-only filesystem or
under a regular file, a local `output.checkpoint_dir` that is read-only, an export target that
cannot be written or holds an earlier export. Each is refused in one line naming the path and the
cause, exit 2, before anything trains or is read; the read-only cases mount a real read-only tmpfs
(root only, else skipped)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_VSRN, TORCHRUN, tmpfs_mounted, train_vsrn

from vldist.errors import OutputNotWritable
from vldist.export import main as export_main
from vldist.training.run_lock import check_free


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a real read-only filesystem (a tmpfs mounted ro), unmounted afterwards."""
    with tmpfs_mounted(tmp_path / "ro", "ro,size=1m") as path:
        yield path


def _cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "error: error:" not in stderr
    return lines[0]


def test_train_under_a_regular_file_is_refused_in_one_line_through_the_cli(planted_shards, tmp_path):
    blocking = tmp_path / "notes.txt"
    blocking.write_text("keep me")
    out = blocking / "run"
    proc = _cli("vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={out}", *SMALL_VSRN)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr) == (
        f"error: cannot write to output.dir {out}: {blocking} is a file, not a directory. "
        f"Choose another output.dir=DIR or move {blocking} out of the way"
    )
    assert blocking.read_text() == "keep me" and proc.stdout == ""


def test_train_into_a_read_only_filesystem_is_refused_in_one_line_through_the_cli(planted_shards, read_only_dir):
    out = read_only_dir / "run"
    proc = _cli("vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={out}", *SMALL_VSRN)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr) == (
        f"error: cannot write to output.dir {out}: Read-only file system. Choose another output.dir=DIR or make it writable"
    )


def test_a_read_only_output_dir_that_exists_is_refused_and_the_ray_driver_check_too(
    planted_shards, read_only_dir, capsys
):
    # the mount itself: it exists, so only writing a file in it (the lock) finds out
    code, err = train_vsrn(capsys, f"data.shards={planted_shards}", f"output.dir={read_only_dir}", *SMALL_VSRN)
    assert code == 2 and f"cannot write to output.dir {read_only_dir}: Read-only file system" in err, err
    with pytest.raises(OutputNotWritable, match="Read-only file system"):
        check_free(read_only_dir / "run")  # what `ray job submit` runs in the driver, before any worker


def test_a_read_only_local_checkpoint_dir_is_refused_before_training(planted_shards, read_only_dir, tmp_path, capsys):
    out, store = tmp_path / "run", f"file://{read_only_dir}/checkpoints"
    code, err = train_vsrn(
        capsys,
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        f"output.checkpoint_dir={store}",
        "train.max_steps=2",
        *SMALL_VSRN,
    )
    assert code == 2, err[-3000:]
    assert (
        f"error: cannot write to output.checkpoint_dir {store}: Read-only file system. "
        "Choose another output.checkpoint_dir=URL or make it writable"
    ) in err
    assert list(out.iterdir()) == []  # refused before the lock, a checkpoint or metrics were written


def test_two_ranks_under_a_regular_file_both_refuse_and_rank_0_says_it_once(planted_shards, tmp_path):
    blocking = tmp_path / "notes.txt"
    blocking.write_text("keep me")
    proc = subprocess.run(
        [*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={planted_shards}", f"output.dir={blocking / 'run'}"]
        + SMALL_VSRN,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if "cannot write to output.dir" in line]
    assert said == [
        f"error: rank 0 on {os.uname().nodename}: cannot write to output.dir {blocking / 'run'}: {blocking} is a "
        f"file, not a directory. Choose another output.dir=DIR or move {blocking} out of the way"
    ], proc.stderr[-3000:]
    # both ranks refused together with 2 (torchrun's summary of each), none waited for the other
    assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]


def test_an_earlier_export_is_replaced_only_with_force_and_one_rank_is_singular(trained_vsrn, tmp_path, capsys):
    out = tmp_path / "export"
    assert export_main([str(trained_vsrn), "--out", str(out)]) == 0
    assert "written by 1 rank under accelerate" in capsys.readouterr().out
    first = (out / "meta.json").stat().st_mtime_ns

    proc = _cli("vldist.export", trained_vsrn, "--checkpoint", "latest", "--out", out)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith(f"error: --out {out} holds an earlier export (") and line.endswith(
        "add --force to replace it, or name a new directory"
    )
    assert (out / "meta.json").stat().st_mtime_ns == first  # left as it was

    assert export_main([str(trained_vsrn), "--checkpoint", "latest", "--out", str(out), "--force"]) == 0
    assert (out / "meta.json").stat().st_mtime_ns != first
    assert "/checkpoints/step-" in (out / "meta.json").read_text()  # now the latest checkpoint's export
    assert not list(tmp_path.glob(".export.*"))  # no temporary or old copy left beside it


def test_an_export_target_that_cannot_be_written_is_refused_in_one_line(trained_vsrn, tmp_path):
    blocking = tmp_path / "notes.txt"
    blocking.write_text("keep me")
    proc = _cli("vldist.export", trained_vsrn, "--out", blocking / "export")
    assert proc.returncode == 2, proc.stderr
    assert _one_line(proc.stderr) == (
        f"error: cannot write to --out {blocking / 'export'}: {blocking} is a file, not a directory. "
        f"Choose another --out DIR or move {blocking} out of the way"
    )


def test_an_export_to_a_read_only_filesystem_is_refused_in_one_line(trained_vsrn, read_only_dir, capsys):
    out = read_only_dir / "deep" / "export"
    assert export_main([str(trained_vsrn), "--out", str(out)]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"error: cannot write to --out {out}: Read-only file system. Choose another --out DIR or make it writable"
    )
    assert not Path(read_only_dir, "deep").exists()
