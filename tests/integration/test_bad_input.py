"""The catalogue of bad input (docs/bad-input.md): each case ends in a message that names what is
wrong and what to do, with the documented exit code, and loses nothing. The commands run in this
process through their `main()`: a traceback would be an exception escaping it."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_VSRN, train_vsrn, wait_for_step, write_planted_shards

from vldist.checkpoint.format import step_checkpoints, verify
from vldist.evaluate import main as evaluate_main
from vldist.shards.format.writer import ShardSetWriter
from vldist.train import main as train_main


def test_an_evaluation_split_that_loses_samples_says_so_and_one_that_loses_all_names_why(
    trained_vsrn, tmp_path, capsys
):
    some = write_planted_shards(tmp_path / "some", unreadable={"test-0000003", "test-0000040", "test-0000041"})
    assert evaluate_main([str(trained_vsrn), "--shards", str(some)]) == 0
    out = capsys.readouterr().out
    assert "57 images, 285 captions" in out
    assert "3 samples of the test split were unreadable and skipped" in out and "57 images that remain" in out

    every = write_planted_shards(tmp_path / "all", unreadable={f"test-{i:07d}" for i in range(60)})
    assert evaluate_main([str(trained_vsrn), "--shards", str(every)]) == 1
    err = capsys.readouterr().err
    assert f"the test split of {every} yielded no samples: 60 were skipped as unreadable" in err
    assert "regions.npy of test-0000000 holds NaN or inf" in err and "vldist.shards verify" in err


def test_a_non_finite_loss_is_an_error_that_names_the_last_checkpoint(planted_shards, tmp_path, capsys):
    code, err = train_vsrn(
        capsys,
        f"data.shards={planted_shards}",
        f"output.dir={tmp_path}",
        "train.epochs=2",
        *SMALL_VSRN,
        "train.lr=1e30",
        "train.grad_clip=null",
    )  # a learning rate that blows up
    assert code == 1
    assert "error: non-finite loss at step" in err and "start again (no checkpoint was written before it)" in err


def test_shards_without_region_features_say_how_to_add_them(tmp_path, capsys):
    with ShardSetWriter(tmp_path / "plain", shard_size=10, source="test") as writer:
        for split in ("train", "val", "test"):
            for i in range(4):
                writer.write(split, {"__key__": f"{split}{i}", "json": {"captions": ["a red circle"]}})
        writer.close({})
    code, err = train_vsrn(capsys, f"data.shards={tmp_path / 'plain'}", f"output.dir={tmp_path / 'run'}", *SMALL_VSRN)
    assert code == 2 and "has no region features" in err and "--features" in err


def test_a_job_file_that_is_not_valid_yaml_is_named_with_its_line(tmp_path, capsys):
    job = tmp_path / "broken.yaml"
    job.write_text("recipe: vsrn\ntrain:\n  lr: [0.1\n")
    assert train_main([str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{job} is not valid YAML" in err and "line" in err


def test_a_second_run_into_the_same_output_dir_refuses_naming_the_first(planted_shards, tmp_path, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            "train.epochs=50",
            "train.log_every=1",
            *SMALL_VSRN,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(out, 1, first)
        code, err = train_vsrn(
            capsys, f"data.shards={planted_shards}", f"output.dir={out}", "train.max_steps=1", *SMALL_VSRN
        )
        assert code == 2
        assert f"output.dir {out} is in use by another run: pid {first.pid} on host" in err
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: the lock must not outlive it
        first.wait()
    code, err = train_vsrn(
        capsys, f"data.shards={planted_shards}", f"output.dir={out}", "train.max_steps=1", *SMALL_VSRN
    )
    assert code == 0, err


def _mount_tmpfs(path: Path, size: str) -> str | None:
    path.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    return None if done.returncode == 0 else (done.stderr.strip() or "mount failed")


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_usable(planted_shards, tmp_path):
    disk = tmp_path / "disk"
    if os.geteuid() != 0 or (why := _mount_tmpfs(disk, "64m")):
        pytest.skip(f"a small tmpfs needs root and mount: {why if os.geteuid() == 0 else 'not root'}")
    try:
        out = disk / "run"
        job = [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            *SMALL_VSRN,
            "data.batch_size=8",
            "train.epochs=2",
            "train.save_every_steps=10",
            "train.log_every=1",
            "train.keep_last=5",
        ]
        proc = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (out / "checkpoints" / "step-00000010" / "COMPLETE").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
        stats = os.statvfs(disk)
        used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        # the disk fills up: room for the progress records, not for another checkpoint
        subprocess.run(["mount", "-o", f"remount,size={used + 128 * 1024}", str(disk)], check=True)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err[-3000:]
        assert "error: cannot write checkpoint" in err and "The disk is full: 0." in err, err[-1500:]
        assert f"The previous checkpoint {out / 'checkpoints' / 'step-00000010'} is complete and usable" in err
        assert "Traceback" not in err
        verify(out / "checkpoints" / "step-00000010")
        assert not list((out / "checkpoints").glob(".*.tmp"))  # the partial write is gone, its space free

        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = subprocess.run([*job, "train.resume=latest"], capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stderr and "step-00000010" in resumed.stderr
        assert step_checkpoints(out / "checkpoints")[-1].name == "step-00000050"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_train_split_with_no_readable_sample_ends_with_an_error_not_a_hang(tmp_path, capsys):
    broken = write_planted_shards(tmp_path / "broken", unreadable={f"train-{i:07d}" for i in range(200)})
    code, err = train_vsrn(
        capsys, f"data.shards={broken}", f"output.dir={tmp_path / 'run'}", "train.epochs=1", *SMALL_VSRN
    )
    assert code == 1
    assert f"epoch 1 yielded no training batches: every sample of the train split of {broken}" in err
    assert "vldist.shards verify" in err


def test_a_damaged_manifest_or_vocabulary_is_named(planted_shards, tmp_path, capsys):
    for damaged, name in (("manifest.json", "is not valid JSON"), ("vocab.json", "cannot read the vocabulary")):
        shards = tmp_path / damaged
        shutil.copytree(planted_shards, shards)
        (shards / damaged).write_text('{"truncated": ')
        code, err = train_vsrn(capsys, f"data.shards={shards}", f"output.dir={tmp_path / 'run'}", *SMALL_VSRN)
        assert code == 2 and str(shards / damaged) in err and name in err, err


def test_ctrl_c_ends_at_once_with_130_and_says_what_is_kept(planted_shards, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            "train.epochs=5000",  # far more than it runs before the Ctrl-C, however fast its steps
            "train.log_every=1",
            *SMALL_VSRN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a terminal's job starts: SIGINT at its default, whatever this process inherited
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for_step(out, 2, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never leave the run behind, whatever failed
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: nothing after the last checkpoint was kept" in err and "Traceback" not in err
