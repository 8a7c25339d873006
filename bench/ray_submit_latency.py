"""Submit-to-first-step latency and wall time of a small Ray job, on a fresh local Ray head.

    python bench/ray_submit_latency.py [--trials 2]

Starts a head on loopback (as tests/integration/test_ray.py does), builds the planted test shards,
submits `python -m vldist.train vsrn` with the Ray test job's settings (2 workers, 14 steps), and
times the submit command until the first progress line and until it returns.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

from helpers import free_port, write_planted_shards  # noqa: E402
from test_ray import JOB, RAY, _stop_head, _wait_for_dashboard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    work = Path(tempfile.mkdtemp(prefix="vrb", dir="/tmp"))
    shards = write_planted_shards(work / "shards")
    port, dashboard = free_port(), free_port()
    started = time.time()
    head = subprocess.Popen(
        [
            *RAY,
            "start",
            "--head",
            "--block",
            "--num-cpus",
            "2",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard),
            "--temp-dir",
            str(work / "ray"),
            "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    _wait_for_dashboard(address, head)
    print(f"head up in {time.time() - started:.1f} s")
    try:
        for trial in range(args.trials):
            start, first = time.time(), None
            proc = subprocess.Popen(
                [
                    *RAY,
                    "job",
                    "submit",
                    "--address",
                    address,
                    "--",
                    sys.executable,
                    "-m",
                    "vldist.train",
                    "vsrn",
                    f"data.shards={shards}",
                    f"ray.storage_path={work / 'runs'}",
                    f"ray.name=trial{trial}",
                    "train.epochs=2",
                    "train.log_every=1",
                    *JOB,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for line in proc.stdout:
                if first is None and "step 1/14" in line:
                    first = time.time() - start
            proc.wait()
            print(
                f"trial {trial + 1}: exit {proc.returncode}, submit to first step {first:.1f} s, "
                f"total {time.time() - start:.1f} s"
            )
    finally:
        _stop_head(head, work / "ray")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
