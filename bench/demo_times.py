"""Each demo's whole command, timed as a newcomer runs it, split into its phases.

    python bench/demo_times.py                                    # all seven demos, their defaults
    python bench/demo_times.py --jobs vsrn l2c --env OMP_NUM_THREADS=1 --set train.threads=1 --label t1
    python bench/demo_times.py --json docs/results/demo_times.json [--append]
    python bench/demo_times.py --from docs/results/demo_times.json   # the table, nothing run

Each demo is `python -m vldist.train <job> output.dir=<tmp dir>` (plus --set overrides, in the
environment plus --env), run under the shared CPU lock (--lock; one demo per hold, so that others
get the lock between demos). Per demo:

- wall s: the whole command, process start to exit (imports, shard opening and every stage);
- outside s: wall minus the stages' own run time (metrics.json `wall_seconds`): imports, opening
  shards, building the model and vocabulary, and the process's exit;
- untrained s, validation s, test s: the evaluations (metrics.json `evaluation_seconds`, summed over
  the stages; the contract check counts as untrained);
- training s: the stages' run time less their evaluations (steps, checkpoints, loader waits);
- the final metrics: each stage's test headline (the recipe's own), to compare with the seed spread.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
JOBS = ["vsrn", "captioner", "cl_caption", "two_branch_embed", "two_branch_sim", "l2c", "laviter"]
# issue 42: each demo's whole command on a quiet machine before this work; the aim is half of it
ISSUE_SECONDS = {
    "vsrn": 246,
    "captioner": 289,
    "cl_caption": 421,
    "two_branch_embed": 168,
    "two_branch_sim": 301,
    "l2c": 532,
    "laviter": 579,
}
# the number of each stage's test that the table shows (the recipe's headline holds them all)
KEY_METRIC = {
    "vsrn": "rsum",
    "captioner": "cider_d",
    "cl_caption": "cider_d",
    "two_branch_embed": "rsum",
    "two_branch_sim": "rsum",
    "l2c": "cider_d",
    "laviter": "rsum",
}
PHRASE_METRIC = "phrase_r1"  # the two-branch jobs' phrase stage


def machine(root: Path = ROOT) -> dict:
    """The CPU, torch and the commit of the checkout at `root`."""
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "commit": commit.stdout.strip()}


def stage_metrics(out_dir: Path) -> dict[str, dict]:
    """Every stage's metrics.json under the run's directory: one at its top, or one per stage."""
    top = out_dir / "metrics.json"
    if top.is_file():
        return {"": json.loads(top.read_text())}
    found = {}
    for path in sorted(out_dir.glob("*/metrics.json"), key=lambda p: p.stat().st_mtime):
        found[path.parent.name] = json.loads(path.read_text())
    return found


def phases(wall: float, stages: dict[str, dict]) -> dict:
    """The command's wall time split as the module docstring says, from each stage's metrics.json."""
    from vldist.recipes import get_recipe

    split = {"untrained_s": 0.0, "validation_s": 0.0, "test_s": 0.0, "training_s": 0.0}
    tests = {}
    inside = 0.0
    for name, metrics in stages.items():
        inside += metrics["wall_seconds"]
        seconds = metrics.get("evaluation_seconds", {})
        untrained = seconds.get("baseline", 0.0) + seconds.get("contract_check", 0.0)
        split["untrained_s"] += untrained
        split["validation_s"] += seconds.get("validation", 0.0)
        split["test_s"] += seconds.get("test", 0.0)
        split["training_s"] += metrics["train_seconds"] - untrained - seconds.get("validation", 0.0)
        tests[name or metrics["recipe"]] = get_recipe(metrics["recipe"]).headline(metrics["test"])
    return {"outside_s": wall - inside, **split, "steps": sum(m["steps"] for m in stages.values()), "test": tests}


class CpuLock:
    """The shared CPU lock (flock(1)'s), held for one demo."""

    def __init__(self, path: str | None):
        self.path, self.fh = path, None

    def __enter__(self):
        if self.path:
            self.fh = open(self.path, "a")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fh is not None:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()


def run_demo(job: str, overrides: list[str], env: dict[str, str], lock: str | None, logs: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"demo-{job}-") as tmp:
        out = Path(tmp) / job
        cmd = [sys.executable, "-m", "vldist.train", job, f"output.dir={out}", *overrides]
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        log_path = logs / f"{job}.log"
        with CpuLock(lock), open(log_path, "w") as log:
            start = time.perf_counter()
            code = subprocess.run(cmd, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT).returncode
            wall = time.perf_counter() - start
        if code:
            raise SystemExit(f"{job} exited {code}: see {log_path}")
        row = {"job": job, "wall_s": wall, **phases(wall, stage_metrics(out))}
    print(
        f"{job}: {wall:.1f} s (outside {row['outside_s']:.1f}, untrained {row['untrained_s']:.1f}, "
        f"training {row['training_s']:.1f}, validation {row['validation_s']:.1f}, test {row['test_s']:.1f}); "
        f"{key_metrics(job, row['test'])}",
        flush=True,
    )
    return row


def key_metrics(job: str, tests: dict[str, dict]) -> str:
    parts = []
    for stage, headline in tests.items():
        for key in (KEY_METRIC[job], PHRASE_METRIC):
            if key in headline:
                parts.append(f"{stage} {key} {headline[key]:.4g}")
    return ", ".join(parts)


def table(results: dict) -> str:
    lines = []
    for run in results["runs"]:
        m = run["machine"]
        setting = " ".join([*(f"{k}={v}" for k, v in run["env"].items()), *run["overrides"]]) or "defaults"
        lines += [
            f"**{run['label']}** ({setting}; {m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']})",
            "",
            "| demo | wall s | issue s | / issue | outside s | untrained s | training s | validation s | test s | steps "
            "| test |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in run["rows"]:
            issue = ISSUE_SECONDS[r["job"]]
            lines.append(
                f"| {r['job']} | {r['wall_s']:.0f} | {issue} | {r['wall_s'] / issue:.2f} | {r['outside_s']:.1f} "
                f"| {r['untrained_s']:.1f} | {r['training_s']:.1f} | {r['validation_s']:.1f} | {r['test_s']:.1f} "
                f"| {r['steps']} | {key_metrics(r['job'], r['test'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=JOBS, choices=JOBS)
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VAL", help="added to the demo's environment")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VAL", help="job overrides (section.key=value)")
    parser.add_argument("--label", default="defaults", help="names this configuration in the JSON and table")
    parser.add_argument("--lock", default="/work/runs/cpu.lock", help="flock file held per demo ('' for none)")
    parser.add_argument("--logs", default=None, help="where the demos' logs go (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--append", action="store_true", help="add this run to the --json file's runs")
    parser.add_argument("--from", dest="from_file", help="print the table of a results file; run nothing")
    args = parser.parse_args()
    if args.from_file:
        print(table(json.loads(Path(args.from_file).read_text())))
        return 0
    logs = Path(args.logs or tempfile.mkdtemp(prefix="demo-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", flush=True)
    env = parse_pairs(args.env)
    run = {"label": args.label, "env": env, "overrides": args.set, "machine": machine(), "rows": []}
    earlier = []
    if args.json and args.append and Path(args.json).is_file():
        earlier = json.loads(Path(args.json).read_text())["runs"]
    for job in args.jobs:
        run["rows"].append(run_demo(job, args.set, env, args.lock or None, logs))
        if args.json:  # after each demo: a later failure keeps what was measured
            Path(args.json).write_text(json.dumps({"runs": [*earlier, run]}, indent=1) + "\n")
    print(table({"runs": [run]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
