"""Where the embedded sets live (vldist/data/embedded_home.py): the name shards/synth is read from
the data home whatever the working directory, a whole set built in the working directory is read
first, each build is said in one line, and an interrupted or failed build leaves nothing behind."""

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from vldist.data import embedded_home
from vldist.data.embedded_home import BuildLock, data_home, ensure_built, locate
from vldist.data.job_shards import build_missing, open_job_shards
from vldist.errors import Interrupted, OutputNotWritable, ShardsNotFoundError
from vldist.exit_codes import INTERRUPTED
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config

WORKER = Path(__file__).parent / "workers" / "embedded_build.py"
READ = "reading the embedded synthetic dataset from"
BUILD = "building the embedded synthetic dataset in"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty data home, and a fresh process's memory of what it has said."""
    monkeypatch.setenv("VLDIST_DATA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(embedded_home, "_said", set())
    return tmp_path / "home"


def built_by(monkeypatch, builder: str) -> None:
    """shards/synth built by this module's `builder`, said as the real set is."""
    real = embedded_home.EMBEDDED_SETS["shards/synth"]
    monkeypatch.setitem(embedded_home.EMBEDDED_SETS, "shards/synth", replace(real, module=__name__, builder=builder))


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_data_home_is_the_variable_else_the_xdg_cache_else_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("VLDIST_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert data_home() == tmp_path / "user" / ".cache" / "vldist"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG spec says
    assert data_home() == tmp_path / "user" / ".cache" / "vldist"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_home() == tmp_path / "xdg" / "vldist"
    monkeypatch.setenv("VLDIST_DATA_HOME", str(tmp_path / "data"))
    assert data_home() == tmp_path / "data"


def test_the_embedded_name_is_read_from_the_data_home_from_any_directory(
    planted_shards, home, tmp_path, monkeypatch, caplog
):
    """The job's value stays `shards/synth`; two working directories read the one set in the data
    home, and the process says once where it reads it."""
    shutil.copytree(planted_shards, home / "synth")
    config = load_config("vsrn", [])
    assert config.data.shards == "shards/synth"
    caplog.set_level(logging.INFO, logger="vldist.train")
    for cwd in ("a", "b"):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        build_missing(config, get_recipe("vsrn"))  # there: nothing to build
        assert open_job_shards(config, get_recipe("vsrn")).main.directory == home / "synth"
        assert not (tmp_path / cwd / "shards").exists()
    assert lines(caplog, READ) == [f"{READ} {home / 'synth'}"]
    assert not lines(caplog, "building")


def test_a_whole_set_in_the_working_directory_is_read_first(planted_shards, home, tmp_path, monkeypatch, caplog):
    """A checkout where the demo built ./shards/synth before reads that set, and says so in one
    line; a directory there without its manifest.json is no set: the data home's is read."""
    shutil.copytree(planted_shards, home / "synth")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards" / "synth").mkdir(parents=True)  # no manifest.json: not a whole set
    assert locate("shards/synth") == home / "synth"
    shutil.rmtree(tmp_path / "shards" / "synth")
    shutil.copytree(planted_shards, tmp_path / "shards" / "synth")
    caplog.set_level(logging.INFO, logger="vldist.train")
    config = load_config("vsrn", [])
    build_missing(config, get_recipe("vsrn"))
    assert open_job_shards(config, get_recipe("vsrn")).main.directory == tmp_path / "shards" / "synth"
    assert lines(caplog, "reading the embedded") == [
        f"{READ} {tmp_path / 'shards' / 'synth'} (found in the working directory; elsewhere it is read from "
        f"{home / 'synth'})"
    ]


def test_without_build_if_missing_the_name_is_a_path_like_any_other(planted_shards, home, tmp_path, monkeypatch):
    shutil.copytree(planted_shards, home / "synth")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardsNotFoundError, match="shard directory 'shards/synth' does not exist"):
        open_job_shards(load_config("vsrn", ["data.build_if_missing=false"]), get_recipe("vsrn"))


def _copy_builder(source: Path):
    def build(out_dir) -> None:
        shutil.copytree(source, out_dir)

    return build


def test_a_build_is_said_in_one_line_and_the_set_read_where_it_was_built(
    planted_shards, home, tmp_path, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "copy_planted", _copy_builder(planted_shards), raising=False)
    built_by(monkeypatch, "copy_planted")
    caplog.set_level(logging.INFO, logger="vldist.train")
    config = load_config("vsrn", [])
    build_missing(config, get_recipe("vsrn"))
    assert open_job_shards(config, get_recipe("vsrn")).main.directory == home / "synth"
    said = [r.getMessage() for r in caplog.records if "embedded" in r.getMessage()]
    assert said == [
        f"{BUILD} {home / 'synth'} (about 1 GB, about a minute and a half; once per machine, VLDIST_DATA_HOME=DIR "
        "builds it elsewhere)"
    ]
    assert sorted(p.name for p in home.iterdir()) == ["synth"]  # no lock file, no .partial


def _failing_builder(error: BaseException):
    def build(out_dir) -> None:
        partial = Path(f"{out_dir}.partial")
        partial.mkdir()
        (partial / "train-000000.tar").write_bytes(b"half a shard")
        raise error

    return build


@pytest.mark.parametrize(
    "error, raised, message",
    [
        (
            KeyboardInterrupt(),
            Interrupted,
            "building the embedded synthetic dataset in {} was interrupted; nothing of it "
            "was kept (the next run builds it again from the start)",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            OutputNotWritable,
            "cannot build the embedded synthetic dataset in {}: No space left on device; what it had written was "
            "removed. It needs about 1 GB of free space: set VLDIST_DATA_HOME to a writable directory with room for "
            "it (each machine builds it there once)",
        ),
        (RuntimeError("a bug"), RuntimeError, "a bug"),
    ],
    ids=["ctrl-c", "disk-full", "other"],
)
def test_a_build_that_fails_leaves_nothing_and_says_what_stopped_it(home, monkeypatch, caplog, error, raised, message):
    monkeypatch.setattr(sys.modules[__name__], "fails", _failing_builder(error), raising=False)
    built_by(monkeypatch, "fails")
    with pytest.raises(raised) as caught:
        ensure_built("shards/synth")
    assert str(caught.value) == message.format(home / "synth")
    assert sorted(p.name for p in home.iterdir()) == []  # no .partial, no lock file
    if raised is RuntimeError:
        assert lines(caplog, "failed") == [
            f"building the embedded synthetic dataset in {home / 'synth'} failed (RuntimeError: a bug); what it had "
            f"written ({home / 'synth.partial'}) was removed, and the next run builds it again from the start"
        ]


def test_a_data_home_that_cannot_be_made_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("VLDIST_DATA_HOME", str(tmp_path / "file" / "home"))
    with pytest.raises(
        OutputNotWritable, match=f"cannot build the embedded synthetic dataset in {tmp_path}/file/home/synth: "
    ):
        ensure_built("shards/synth")


def test_a_lock_waited_on_while_its_holder_removed_it_is_taken_anew(tmp_path):
    """The holder removes the lock file on release; a process that was waiting on that file (its
    inode) must not take it as held while a third locks the new file at the path."""
    path = tmp_path / "set.lock"
    first = BuildLock(path)
    first.acquire()
    held = threading.Event()
    second = BuildLock(path)

    def wait_for_it():
        second.acquire()
        held.set()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    time.sleep(0.3)
    assert not held.is_set()  # the first holds it
    first.release()
    assert held.wait(10)
    assert (
        path.exists() and os.fstat(second.fd).st_ino == path.stat().st_ino
    )  # the file at the path, not the removed one
    with pytest.raises(BlockingIOError):  # held: a third may not take it
        import fcntl

        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    second.release()
    waiter.join()
    assert not path.exists()


def test_ctrl_c_while_another_process_builds_says_so_and_leaves_its_lock(home):
    """Ctrl-C in a job that waits for another's build: it says what it waited for; the lock file
    stays, the other's."""
    home.mkdir()
    other = BuildLock(home / "synth.lock")
    other.acquire()
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(Interrupted) as caught:
            ensure_built("shards/synth")
        assert str(caught.value) == (
            f"waiting for another process to build the embedded synthetic dataset in {home / 'synth'} was "
            "interrupted; that build goes on"
        )
        assert sorted(p.name for p in home.iterdir()) == ["synth.lock"]
    finally:
        other.release()


def test_ctrl_c_during_the_build_says_so_leaves_no_lock_and_the_next_build_completes(tmp_path):
    """`python -m vldist.train vsrn` building the embedded set, interrupted with SIGINT: exit 130
    and one line that says the build was interrupted (not training, no traceback), no lock file,
    no .partial; the next build then runs to its end."""
    home = tmp_path / "home"
    env = {**os.environ, "VLDIST_DATA_HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    process = subprocess.Popen(
        [sys.executable, str(WORKER), "train", str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (home / "synth.partial" / "started").exists():
            assert process.poll() is None and time.time() < deadline, process.communicate()
            time.sleep(0.1)
        assert (home / "synth.lock").exists()  # held while the build runs
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == INTERRUPTED, err
    assert "Traceback" not in err and "checkpoint" not in err, err
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert said == [
        f"interrupted: building the embedded synthetic dataset in {home / 'synth'} was interrupted; nothing of it "
        "was kept (the next run builds it again from the start)"
    ], err
    assert sorted(p.name for p in home.iterdir()) == []  # no lock file, no .partial, no set
    again = subprocess.run(
        [sys.executable, str(WORKER), "build"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and again.stdout.strip() == str(home / "synth"), again.stderr
    assert sorted(p.name for p in home.iterdir()) == ["synth"]
    assert sorted(p.name for p in (home / "synth").iterdir()) == ["manifest.json", "started"]
