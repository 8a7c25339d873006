"""One run per output directory (vldist/training/run_lock.py)."""

import subprocess
import sys
import textwrap

import pytest

from vldist.errors import OutputDirInUse
from vldist.training.run_lock import RunLock, check_free


def test_the_lock_refuses_a_second_holder_naming_it_and_dies_with_its_process(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from vldist.training.run_lock import RunLock
            RunLock({str(tmp_path)!r}).acquire()
            print("held", flush=True)
            time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse) as refused:
            RunLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host" in message and "set another output.dir" in message
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    check_free(tmp_path)  # the kernel dropped the lock with the process
    with RunLock(tmp_path):
        pass
