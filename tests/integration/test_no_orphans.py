"""No process of a run outlives it, whatever ends it (distributed/orphans.py).

Each test starts `python -m vldist.train` with two loader workers, records every process below it
from /proc while it runs (by parent pid, with each one's start time, so that a reused pid is told
apart), ends it, and then checks that none of them is alive a few seconds after its exit. Loader
workers start by fork from local shards and from a fork server (data/pipeline.py's _worker_start)
from shards at a URL (file:// here).

- The hang watchdog's exit (3), taken by os._exit, which skips every cleanup. The loader workers
  are stopped (SIGSTOP) first: a worker inside a batch that never ends, which is what hangs the
  run, never looks for its parent; stopped, it is also what makes the run hang. (A worker from a
  fork server outlived such an exit even idle: it watches the server, which waited for it.)
- SIGKILL of the run's process, its workers stopped likewise: nothing runs in the process; the
  kernel ends the workers (die_with_parent, in data/pipeline.py's _init_worker).
- A normal exit and a non-finite loss (exit 1): the loaders' own shutdown.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import PREEMPT_JOB, wait_for_step

from vldist.distributed.orphans import descendants
from vldist.exit_codes import HUNG

pytestmark = pytest.mark.slow

GRACE_S = 5.0  # after the run's exit: the kernel's delivery of SIGKILL and the reaping take far less


def started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None once it has ended (zombies too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Tree:
    """Every process that was below `root` while it ran, sampled every 50 ms: {pid: start time}."""

    def __init__(self, root: int):
        self.root, self.seen, self._done = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(0.05)

    def sample(self) -> None:
        for pid in descendants(self.root):
            start = started(pid)
            if start is not None:
                self.seen.setdefault(pid, start)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def alive(self) -> dict[int, str]:
        """Those still running (the same process: its start time unchanged), with their command lines."""
        return {pid: command(pid) for pid, start in self.seen.items() if started(pid) == start}

    def left_after(self, grace_s: float = GRACE_S) -> dict[int, str]:
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.alive()

    def kill_left(self) -> None:
        """What a failed test leaves: SIGKILL, by pid (a stopped process acts on nothing else)."""
        for pid in self.alive():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def runs():
    """The runs a test starts; whatever of them is left is killed after it."""
    started_runs: list[tuple[subprocess.Popen, Tree]] = []
    yield started_runs
    for proc, tree in started_runs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        tree.stop()
        tree.kill_left()


def start_run(runs: list, shards: str, run: Path, *overrides: str) -> tuple[subprocess.Popen, Tree, Path]:
    log = run.parent / f"{run.name}.log"
    job = [
        sys.executable,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={shards}",
        f"output.dir={run}",
        *PREEMPT_JOB,
        "data.workers=2",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its output to a file: a pipe would be held open by any process it leaves behind
    with open(log, "w") as out:
        proc = subprocess.Popen(job, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree = Tree(proc.pid)
    runs.append((proc, tree))
    return proc, tree, log


def stop_loader_workers(tree: Tree) -> list[int]:
    """SIGSTOP the run's loader workers: the processes at the bottom of its tree (forked by the run,
    or by its fork server), but not multiprocessing's resource tracker."""
    tree.sample()
    below = descendants(tree.root)
    parents = set(below.values())
    workers = [pid for pid in below if pid not in parents and "resource_tracker" not in command(pid)]
    assert len(workers) == 2, {pid: command(pid) for pid in below}
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    return workers


def shards_as(planted_shards: Path, start: str) -> str:
    """The planted set as a path (workers forked) or a file:// URL (workers from a fork server)."""
    return str(planted_shards) if start == "fork" else planted_shards.resolve().as_uri()


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_the_hang_watchdogs_exit_leaves_no_process_behind(planted_shards, tmp_path, runs, start):
    run = tmp_path / "run"
    proc, tree, log = start_run(
        runs, shards_as(planted_shards, start), run, "train.epochs=20", "train.hang_timeout_s=10"
    )
    wait_for_step(run, 3, proc)
    stop_loader_workers(tree)  # the run takes the batches they made, then waits for data: a hang
    assert proc.wait(90) == HUNG, log.read_text()[-3000:]
    assert "no rank of the run advanced" in log.read_text()
    left = tree.left_after()
    assert left == {}, f"left running: {left}\n{log.read_text()[-3000:]}"


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_run_killed_outright_leaves_no_process_behind(planted_shards, tmp_path, runs, start):
    run = tmp_path / "run"
    proc, tree, log = start_run(runs, shards_as(planted_shards, start), run, "train.epochs=20")
    wait_for_step(run, 3, proc)
    stop_loader_workers(tree)
    tree.sample()
    proc.kill()  # SIGKILL: what the kernel's OOM killer or a launcher's hard stop does
    assert proc.wait(30) == -signal.SIGKILL
    left = tree.left_after()
    assert left == {}, f"left running: {left}\n{log.read_text()[-3000:]}"


@pytest.mark.parametrize(
    "overrides, code",
    [
        (["train.max_steps=4"], 0),
        (["train.max_steps=4", "train.lr=1e30", "train.grad_clip=null"], 1),  # a non-finite loss ends it
    ],
    ids=["normal", "non_finite_loss"],
)
def test_a_run_that_ends_by_itself_leaves_no_process_behind(planted_shards, tmp_path, runs, overrides, code):
    proc, tree, log = start_run(runs, str(planted_shards), tmp_path / "run", *overrides)
    assert proc.wait(120) == code, log.read_text()[-3000:]
    assert len(tree.seen) >= 2, tree.seen  # its loader workers were seen
    left = tree.left_after()
    assert left == {}, f"left running: {left}\n{log.read_text()[-3000:]}"


# die_with_parent and end_descendants on their own, in a process of their own: a "worker" that
# never looks for its parent (it sleeps), started by fork or from a fork server.
WORKER_PARENT = """
import json, multiprocessing, multiprocessing.forkserver, sys, time
from vldist.distributed.orphans import die_with_parent, end_descendants

def sleeper(dies_with_parent):
    if dies_with_parent:
        assert die_with_parent()
    time.sleep(600)

if __name__ == "__main__":
    worker = multiprocessing.get_context(sys.argv[1]).Process(target=sleeper, args=(sys.argv[2] == "1",))
    worker.start()
    print(worker.pid, flush=True)
    if sys.argv[3] == "end":
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        print(json.dumps({"ended": end_descendants(), "expected": sorted(filter(None, [worker.pid, server]))}))
        sys.stdout.flush()
    time.sleep(600)
"""


@pytest.fixture
def worker_parent(tmp_path):
    """Starts the script above; kills what is left of it afterwards, by pid."""
    script = tmp_path / "parent.py"
    script.write_text(WORKER_PARENT)
    made: list[tuple[subprocess.Popen, Tree]] = []

    def start(start_method: str, dies_with_parent: bool, then: str = "sleep") -> tuple[subprocess.Popen, int, Tree]:
        parent = subprocess.Popen(
            [sys.executable, str(script), start_method, "1" if dies_with_parent else "0", then],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        tree = Tree(parent.pid)
        made.append((parent, tree))
        worker = int(parent.stdout.readline())
        tree.sample()  # the worker recorded before a test ends its parent, for the clean-up
        return parent, worker, tree

    yield start
    for parent, tree in made:
        parent.kill()
        parent.wait(30)
        tree.stop()
        tree.kill_left()


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_worker_that_dies_with_its_parent_ends_when_the_parent_is_killed(worker_parent, start):
    parent, worker, tree = worker_parent(start, dies_with_parent=True)
    time.sleep(1)  # the worker is past die_with_parent
    tree.sample()
    assert started(worker) is not None and worker in tree.seen
    parent.kill()
    parent.wait(30)
    assert tree.left_after() == {}


def test_without_it_a_worker_that_never_looks_outlives_its_killed_parent(worker_parent):
    """What die_with_parent is for: the same worker without it is left running."""
    parent, worker, tree = worker_parent("fork", dies_with_parent=False)
    start = started(worker)
    parent.kill()
    parent.wait(30)
    time.sleep(1)
    assert started(worker) == start


def test_end_descendants_ends_every_process_below_this_one_and_spares_the_resource_tracker(worker_parent):
    """A fork server, its worker and multiprocessing's resource tracker below a process: the worker
    and the server end within end_descendants; the tracker, spared, ends by itself once the
    process has gone, as it does after any exit."""
    parent, worker, tree = worker_parent("forkserver", dies_with_parent=False, then="end")
    said = json.loads(parent.stdout.readline())
    assert said["ended"] == said["expected"] and worker in said["ended"] and len(said["ended"]) == 2
    assert started(worker) is None
    tree.sample()
    left = [command(pid) for pid in tree.alive()]
    assert len(left) == 1 and "resource_tracker" in left[0], left
    parent.kill()
    parent.wait(30)
    assert tree.left_after() == {}
