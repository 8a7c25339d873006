"""Which gloo threads (a process group's C++ worker and transport threads) a rank still runs when
its interpreter starts its teardown, where such a thread can abort the process
(vldist/distributed/teardown.py). A torchrun worker calls report_at_exit() before it makes an
engine; the test reads every rank's report with assert_no_gloo_thread_at_exit()."""

import atexit
import os
import sys
from pathlib import Path

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
MARK = "gloo threads at interpreter teardown:"
TASKS = Path("/proc/self/task")  # Linux: a thread's name in TASKS/<tid>/comm


def report_at_exit() -> None:
    """Registered before vldist's exit hook (an engine registers it when made), so it runs after it:
    atexit runs the hooks last registered first, and the teardown follows the last."""
    atexit.register(_report)


def _report() -> None:
    names = [(TASKS / task / "comm").read_text().strip() for task in os.listdir(TASKS)]
    left = sorted(name for name in names if name in GLOO_THREADS)
    sys.stderr.write(f"rank {os.environ.get('RANK')} {MARK} {','.join(left) or 'none'}\n")
    sys.stderr.flush()


def assert_no_gloo_thread_at_exit(stderr: str, ranks: int) -> None:
    assert "terminate called" not in stderr, stderr[-4000:]
    if not TASKS.is_dir():
        return
    reports = sorted(line for line in stderr.splitlines() if MARK in line)
    assert len(reports) == ranks, stderr[-4000:]
    assert [line.split(MARK)[1].strip() for line in reports] == ["none"] * ranks, reports
