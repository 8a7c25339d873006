"""Hangs and stragglers named in seconds (distributed/watchdog.py), on two real gloo ranks started
as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so that the test knows each
rank's pid: SIGSTOP freezes a rank as a wedged GPU or a swapped-out host would.

- A frozen rank: the other exits HUNG (3) within train.hang_timeout_s and a margin, naming the
  frozen rank by host and pid, with its own stack.
- engine.timeout_s alone (the watchdog off): torch.distributed's own timeout ends the wait, in one
  line instead of a traceback.
- A rank slowed on a duty cycle: rank 0's progress lines and one rate-limited warning name it.
"""

import datetime
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import PREEMPT_JOB, free_port, wait_for_step

from vldist.distributed.watchdog import WARN_EVERY_S
from vldist.exit_codes import HUNG

pytestmark = pytest.mark.slow


def start_two_ranks(planted_shards, run, *overrides) -> list[subprocess.Popen]:
    port = free_port()
    job = [
        sys.executable,
        "-m",
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={run}",
        *PREEMPT_JOB,
        "train.epochs=20",
        *overrides,
    ]
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "OMP_NUM_THREADS": "1",
        }
        ranks.append(
            subprocess.Popen(
                job, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
    return ranks


def end(ranks: list[subprocess.Popen]) -> None:
    for rank in ranks:  # by pid: a stopped rank takes SIGKILL
        if rank.poll() is None:
            rank.kill()
        rank.communicate(timeout=30)


@pytest.fixture
def two_ranks():
    started: list[subprocess.Popen] = []
    yield started
    end(started)


def test_a_frozen_rank_is_named_and_the_other_exits_hung_within_the_timeout(planted_shards, tmp_path, two_ranks):
    """Under Accelerate; the watchdog is the engine's neighbour, not part of it (DeepSpeed ran the
    same way when this was written, and its process group's timeout is checked below)."""
    run = tmp_path / "run"
    two_ranks += start_two_ranks(planted_shards, run, "train.hang_timeout_s=6")
    wait_for_step(run, 10, two_ranks[0])
    time.sleep(1.5)  # a heartbeat or two with rank 1's step on it
    os.kill(two_ranks[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    out = two_ranks[0].communicate(timeout=60)[0]
    took = time.monotonic() - stopped
    assert two_ranks[0].returncode == HUNG, out[-3000:]
    assert took < 6 + 2 * 0.6 + 8, took  # the timeout, the report's two heartbeats, process exit
    said = next(line for line in out.splitlines() if line.startswith("error: no rank of the run advanced"))
    assert f"rank 1 on {socket.gethostname()} (pid {two_ranks[1].pid}) stopped responding, last at step" in said
    assert "train.hang_timeout_s=6" in said and "train.resume=auto" in said
    assert f"waiting for it: rank 0 on {socket.gethostname()} (pid {two_ranks[0].pid})" in said
    assert "most recent call first" in out and "training/loop.py" in out  # its own stack, from faulthandler
    assert "Traceback" not in out


def test_engine_timeout_ends_a_wait_for_a_frozen_rank_in_one_line(planted_shards, tmp_path, two_ranks):
    run = tmp_path / "run"
    two_ranks += start_two_ranks(planted_shards, run, "train.hang_timeout_s=0", "engine.timeout_s=5")
    wait_for_step(run, 5, two_ranks[0])
    os.kill(two_ranks[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    out = two_ranks[0].communicate(timeout=60)[0]
    took = time.monotonic() - stopped
    # The 5 s timeout, the step in flight and the interpreter's exit (about 3 s of torch's teardown
    # on a loaded 2-core host: 10.9 to 12.7 s in all with two busy loops beside it); far below the
    # default engine.timeout_s of 1800 s, which is what the bound tells apart.
    assert two_ranks[0].returncode == 1 and took < 5 + 20, (took, out[-3000:])
    assert f"error: rank 0 on {socket.gethostname()}: a collective waited longer than engine.timeout_s" in out
    assert "Traceback" not in out and "no rank of the run advanced" not in out


PROCESS_GROUP_TIMEOUT = """
import sys, torch, torch.distributed as dist
from vldist.config import JobConfig
from vldist.distributed import make_engine
job = JobConfig.model_validate({"recipe": "vsrn", "engine": {"backend": sys.argv[1], "timeout_s": 7}})
engine = make_engine(job)
print(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
engine.close()
"""


@pytest.mark.parametrize("backend", ["accelerate", "deepspeed"])
def test_engine_timeout_is_the_process_groups(backend):
    """Both engines hand engine.timeout_s to the process group they make (read back from gloo)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", PROCESS_GROUP_TIMEOUT, backend], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "7.0"


def test_a_rank_slowed_on_a_duty_cycle_is_named_as_the_straggler(planted_shards, tmp_path, two_ranks):
    run = tmp_path / "run"
    two_ranks += start_two_ranks(planted_shards, run, "train.epochs=3", "train.hang_timeout_s=20", "train.log_every=3")
    wait_for_step(run, 3, two_ranks[0])
    done = threading.Event()

    def slow_down(pid: int) -> None:  # stopped 80% of the time: far beyond what a busy machine does to rank 0
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.08)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)

    slower = threading.Thread(target=slow_down, args=(two_ranks[1].pid,), daemon=True)
    slower.start()
    try:
        out = two_ranks[0].communicate(timeout=240)[0]
    finally:
        done.set()
        slower.join()
    assert two_ranks[0].returncode == 0, out[-3000:]
    # Rank 0 logs and records every few steps, and the suite's other worker takes CPU from it, so
    # it may be named itself now and then; once rank 1 runs at a fifth of its speed, rank 1 is.
    notes = [line.partition("| slowest: ")[2] for line in out.splitlines() if " step " in line and "/75 |" in line]
    # On a loaded machine some intervals name no one (the ratio dips under 1.5): count the names.
    named = [note.partition(" takes")[0] for note in notes if note]
    assert named.count(f"rank 1 on {socket.gethostname()}") >= 3, notes
    # Most often rank 1. (Twice as often as rank 0 held in most CI runs, but one run beside the
    # two-node Ray tests named rank 1 12 times and rank 0 6.)
    assert named.count(f"rank 1 on {socket.gethostname()}") > named.count(f"rank 0 on {socket.gethostname()}"), notes
    # warned, and at most once a minute for a rank (WARN_EVERY_S): a slow machine's run may span minutes
    warnings = [line for line in out.splitlines() if "straggler: rank 1" in line]
    times = [datetime.datetime.strptime(line.split()[0], "%H:%M:%S") for line in warnings]
    assert times, notes
    gaps = [(later - earlier).total_seconds() % 86400 for earlier, later in itertools.pairwise(times)]
    assert all(gap >= WARN_EVERY_S - 1 for gap in gaps), warnings  # -1: the log's whole seconds
