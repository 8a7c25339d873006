"""The demo before and after issue 23's first fix: a copy of an image in a batch is no longer its
own hardest negative (data/identity.py). Three seeds of `python -m vldist.train vsrn` each:

    python bench/duplicates_ablation.py [--root runs/dup_fix] [--seeds 0 1 2] [--before 76ab57c]
    python bench/duplicates_ablation.py --from docs/results/duplicates_ablation.json   # the table

    before   vldist at commit --before (the last before the fix), run from a git worktree of it
    fix1     this checkout with model.caption_loss_reduction=token: the fix alone, VSRN's caption
             loss still the per-token mean it was before (the later fix to it changes the demo too)

Both read this checkout's shards/synth (built on first use). A run whose metrics.json exists is
kept. How often a batch holds a copy at all: bench/duplicate_negatives.py.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from ablation_runs import REPO, Col, Recorder, Row, ablation_table, bench_main, blocks, pick, spread_line, train_once

ROWS = [
    Row("before", "before the fix (copies are negatives)", "vsrn", []),
    Row("fix1", "after it (copies are not)", "vsrn", ["model.caption_loss_reduction=token"]),
]
METRICS = {k: ("test", "full", k) for k in ("i2t_r1", "t2i_r1", "rsum")}
COLUMNS = [Col("i2t_r1", "i2t R@1"), Col("t2i_r1", "t2i R@1"), Col("rsum", "rsum")]


def tables(data: dict) -> str:
    return blocks(
        ablation_table(data, ROWS, COLUMNS, per_seed=COLUMNS[2], first="the demo (jobs/vsrn.yaml)"),
        spread_line(data, ROWS, COLUMNS[2], [("before", "fix1")]),
    )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", default="76ab57c", help="the commit before the fix (default: %(default)s)")


def train(args: argparse.Namespace, root: Path, record: Recorder) -> list[str]:
    common = ["eval.baseline=false", "metrics.enabled=false", f"data.shards={REPO / 'shards' / 'synth'}"]
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        for row in ROWS:
            for seed in args.seeds:
                run_dir = root / row.key / f"seed{seed}"
                cwd = None
                if row.key == "before" and not (run_dir / "metrics.json").exists():
                    if not before.exists():  # the old code, checked out beside this one
                        subprocess.run(
                            ["git", "worktree", "add", "-q", "--detach", str(before), args.before], cwd=REPO, check=True
                        )
                    cwd = before
                run = train_once(row.job, run_dir, [*row.overrides, f"seed={seed}", *common], cwd=cwd)
                record(row, seed, run, pick(run.metrics, METRICS))
        if before.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=True)
    return common


def main() -> None:
    bench_main(__doc__, "duplicates", "duplicates_ablation.py", ROWS, COLUMNS, train, tables, options)


if __name__ == "__main__":
    main()
