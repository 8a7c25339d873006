"""What the ablation benches share: one training run per process, kept once finished, and the
mean ± spread over seeds."""

from __future__ import annotations

import argparse
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


def ablation_parser(doc: str, name: str, row_keys: list[str] | None = None) -> argparse.ArgumentParser:
    """The options every ablation bench takes: --root (default runs/NAME), --seeds, and --rows
    when the bench has named rows (default: all of them)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("runs") / name)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    if row_keys is not None:
        parser.add_argument("--rows", nargs="+", choices=row_keys, default=list(row_keys))
    return parser


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header line, its rule, then one line per row of cells."""
    lines = [head, *rows]
    text = ["| " + " | ".join(cells) + " |" for cells in lines]
    text.insert(1, "|" + "---|" * len(head))
    return "\n".join(text)


def report(root: Path, text: str, raw: dict, key: str = "table") -> None:
    """Print the table(s) and write them, with the raw numbers, to root/ablation.json."""
    print("\n" + text)
    (root / "ablation.json").write_text(json.dumps({key: text, **raw}, indent=2) + "\n")
    print(f"\n{root / 'ablation.json'}")
