"""Step time with and without the Prometheus exporter, on the demo model and the embedded shards.

    python bench/exporter_overhead.py [--steps 100] [--repeats 3]

Runs `python -m vldist.train vsrn` (one process) alternately with metrics.enabled=true/false, no
validation or baseline, and compares the mean time per optimizer step (training time / steps,
from metrics.json). Whole runs differ by more than the exporter costs, so it also times the
exporter's per-step work alone (RankMetrics.observe_step). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(enabled: bool, steps: int, out: Path) -> float:
    cmd = [
        sys.executable,
        "-m",
        "vldist.train",
        "vsrn",
        f"output.dir={out}",
        f"train.max_steps={steps}",
        "train.validate_every=0",
        "eval.baseline=false",
        f"metrics.enabled={str(enabled).lower()}",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    metrics = json.loads((out / "metrics.json").read_text())
    history = metrics["history"]
    return metrics["train_seconds"] / metrics["steps"] if history else float("nan")


def per_step_cost(calls: int = 20000) -> float:
    """Seconds the exporter adds to one step: the metric updates the trainer makes per step."""
    import socket
    import time

    from vldist.telemetry.prometheus import RankMetrics

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics = RankMetrics("127.0.0.1", port, job="bench", recipe="vsrn", rank=0)
    losses = {"loss": 1.0, "matching": 0.9, "caption": 0.1, "grad_norm": 2.0}
    start = time.perf_counter()
    for _ in range(calls):
        metrics.observe_step(samples=128, step_seconds=0.4, wait_seconds=0.01, losses=losses, lr=1e-3, grad_norm=2.0)
    elapsed = (time.perf_counter() - start) / calls
    metrics.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for enabled in (False, True):
                times[enabled].append(one_run(enabled, args.steps, Path(tmp) / f"{enabled}-{r}"))
                print(
                    f"repeat {r + 1} metrics={'on ' if enabled else 'off'}: {1000 * times[enabled][-1]:.1f} ms/step",
                    flush=True,
                )
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median ms/step: off {1000 * off:.1f}, on {1000 * on:.1f}, overhead {100 * (on - off) / off:+.1f}%")
    cost = per_step_cost()
    print(f"exporter work per step: {1e6 * cost:.1f} us = {100 * cost / off:.3f}% of a {1000 * off:.0f} ms step")


if __name__ == "__main__":
    main()
