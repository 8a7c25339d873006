"""Ctrl-C while `python -m vldist.shards synth` builds a set: one line saying nothing was kept, exit
130, and nothing left at --out or beside it (docs/bad-input.md)."""

import signal
import subprocess
import sys
import time


def test_ctrl_c_during_synth_says_nothing_was_kept_and_leaves_nothing(tmp_path):
    out = tmp_path / "synth"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vldist.shards", "synth", "--out", str(out), "--train", "400", "--val", "0"]
        + ["--test", "0", "--shard-size", "20", "--image-size", "64", "--proposals", "0", "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        partial = tmp_path / "synth.partial"
        while not any(partial.glob("train-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # mid-build: its first shard is being written
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == f"interrupted: nothing of {out} was kept (a set is written whole or not at all); " + (
        "the same command builds it again"
    )
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no set, no synth.partial
