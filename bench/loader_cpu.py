"""The CPU a training loader's workers spend per batch: what the loader takes from the trainer's
step on a machine of few cores, where the workers and the trainer's threads share the cores.

    python bench/loader_cpu.py                                      # every case, this checkout
    python bench/loader_cpu.py --root /path/to/worktree --label before --json F --append
    python bench/loader_cpu.py --from docs/results/loader_cpu.json  # the tables, nothing run

Each case is one job stage's training stream (`TrainingStreams`, the job's own workers and batch
size): three batches to warm up, then `--batches` taken as fast as the loader gives them. Per
batch: the workers' CPU seconds (user + system of the loader's child processes, psutil), the
trainer process's own (receiving the batch), and the wall time. Each case runs in a process of
its own with its working directory and PYTHONPATH at `--root`, so that a git worktree of another
commit is measured by the same script; the case's rounds alternate with the other cases'.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# case -> (job, stage): the stage's training stream ("" for a job of one stage)
CASES = {
    "vsrn": ("vsrn", ""),
    "two_branch_embed phrases": ("two_branch_embed", "phrases"),
    "two_branch_sim phrases": ("two_branch_sim", "phrases"),
    "l2c": ("l2c", "l2c"),  # pairs and single images: pixels decoded in the workers
}


def stage_recipe(job: str, stage: str, overrides: list[str] = ()):
    """A job's stage ("" for a job of one stage) as its training opens it, output in a temporary
    directory: the stage's config, its recipe and its shards (built if missing)."""
    from vldist.data.job_shards import build_missing, open_job_shards
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    out = tempfile.mkdtemp(prefix="vldist-bench-")
    config = load_config(job, ["metrics.enabled=false", *overrides, f"output.dir={out}"])
    recipe_cls = get_recipe(config.recipe)
    config = dict(recipe_cls.stages(config)).get(stage, config)
    build_missing(config, recipe_cls)
    shards = open_job_shards(config, recipe_cls)
    vocab = shards.main.vocab(config.output_dir, config.data.vocab_min_count)
    return config, recipe_cls(config, vocab, shards.main.feature_dim()), shards


def stage_batches(job: str, stage: str, count: int, overrides: list[str] = ()):
    """A job stage's recipe and its first `count` training batches, read in this process without
    loader workers (for benches that time steps, not the loader), less the loader's skip counts."""
    from vldist.data.streams import TrainingStreams

    config, recipe, shards = stage_recipe(job, stage, ["data.workers=0", *overrides])
    streams = TrainingStreams(config, recipe, shards, rank=0, world_size=1)
    try:
        stream = streams.batches(epoch=0)
        taken = [next(stream) for _ in range(count)]
    finally:
        streams.close()
    for batch in taken:
        batch.pop("skipped", None), batch.pop("skip_reasons", None), batch.pop("skipped_by_shard", None)
    return recipe, taken


def measure_case(job: str, stage: str, batches: int) -> dict:
    """One pass over a case in this process, vldist imported from the working directory (the checkout
    measured; the row records which)."""
    sys.path.insert(0, os.getcwd())
    import psutil

    import vldist
    from vldist.data.streams import TrainingStreams

    config, recipe, shards = stage_recipe(job, stage)
    streams = TrainingStreams(config, recipe, shards, rank=0, world_size=1)
    me = psutil.Process()

    def cpu_seconds() -> tuple[float, float]:
        workers = sum(sum(child.cpu_times()[:2]) for child in me.children(recursive=True))
        return workers, sum(me.cpu_times()[:2])

    try:
        stream = streams.batches(epoch=0)
        for _ in range(3):
            next(stream)
        (workers0, own0), start = cpu_seconds(), time.perf_counter()
        rows = 0
        for _, batch in zip(range(batches), stream, strict=False):
            rows += next(v.shape[0] for v in batch.values() if hasattr(v, "shape") and v.ndim)
        wall = time.perf_counter() - start
        workers1, own1 = cpu_seconds()
    finally:
        streams.close()
    return {
        "vldist": str(Path(vldist.__file__).resolve().parents[1]),
        "workers": config.data.workers,
        "rows_per_batch": rows / batches,
        "workers_cpu_ms": 1e3 * (workers1 - workers0) / batches,
        "trainer_cpu_ms": 1e3 * (own1 - own0) / batches,
        "wall_ms": 1e3 * wall / batches,
    }


def run_case(root: Path, case: str, batches: int, lock: str | None) -> dict:
    job, stage = CASES[case]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", job, stage, str(batches)]
    with open(lock or os.devnull) as held:
        if lock:
            fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{case} at {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    lines = []
    for run in results["runs"]:
        m = run["machine"]
        lines += [
            f"**{run['label']}** ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']}; "
            f"median of {run['rounds']} rounds of {run['batches']} batches)",
            "",
            "| stage | workers | rows a batch | workers' CPU ms a batch | trainer's CPU ms a batch | wall ms a batch |",
            "|---|---|---|---|---|---|",
        ]
        for row in run["rows"]:
            lines.append(
                f"| {row['case']} | {row['workers']} | {row['rows_per_batch']:.0f} | {row['workers_cpu_ms']:.0f} "
                f"| {row['trainer_cpu_ms']:.0f} | {row['wall_ms']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout measured")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--lock", default="/work/runs/cpu.lock", help="flock file held per case ('' for none)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--append", action="store_true", help="add this run to the --json file's runs")
    parser.add_argument("--from", dest="from_file", type=Path, help="print the tables of a results file; run nothing")
    parser.add_argument("--one", nargs=3, metavar=("JOB", "STAGE", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        job, stage, batches = args.one
        print(json.dumps(measure_case(job, stage, int(batches))))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from demo_times import machine

    if args.from_file:
        print(table(json.loads(args.from_file.read_text())), end="")
        return
    rounds = {case: [] for case in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            rounds[case].append(run_case(args.root.resolve(), case, args.batches, args.lock or None))
    rows = []
    for case, measured in rounds.items():
        if {m["vldist"] for m in measured} != {str(args.root.resolve())}:
            raise RuntimeError(f"{case} imported vldist from {measured[0]['vldist']}, not from --root {args.root}")
        row = {"case": case, "workers": measured[0]["workers"], "rows_per_batch": measured[0]["rows_per_batch"]}
        for key in ("workers_cpu_ms", "trainer_cpu_ms", "wall_ms"):
            row[key] = statistics.median(m[key] for m in measured)
            row[f"{key}_all"] = [m[key] for m in measured]
        rows.append(row)
    run = {"label": args.label, "machine": machine(args.root), "batches": args.batches, "rounds": args.rounds}
    run["rows"] = rows
    earlier = json.loads(args.json.read_text())["runs"] if args.json and args.append and args.json.is_file() else []
    results = {"runs": [*earlier, run]}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table({"runs": [run]}), end="")


if __name__ == "__main__":
    main()
