"""What the ablation benches share: one training run per process, kept once finished, and the
mean ± spread over seeds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def train_once(job: str, run_dir: Path, argv: list[str], results: str = "metrics.json") -> tuple[dict, float | None]:
    """`python -m vldist.train JOB ARGV output.dir=RUN_DIR` in a fresh process, its output in
    run_dir/train.log, unless run_dir/`results` is there from an earlier invocation (an
    interrupted bench resumes). `results`: where the job writes its metrics under run_dir (a
    staged job: in its stage's directory, e.g. cl/metrics.json). Returns the metrics and the
    seconds taken (None: kept)."""
    seconds = None
    if not (run_dir / results).exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "train.log", "w") as log:
            done = subprocess.run([sys.executable, "-m", "vldist.train", job, *argv, f"output.dir={run_dir}"],
                                  stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            sys.exit(f"{run_dir}: training failed (exit {done.returncode}), see {run_dir / 'train.log'}")
        seconds = time.perf_counter() - start
    return json.loads((run_dir / results).read_text()), seconds


def mean_std(values: list[float], digits: int = 1) -> str:
    """'m ± s' with the sample std; just 'm' for one value."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
