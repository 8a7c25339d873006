"""What checkpointing costs the training steps: synchronous vs asynchronous, plain vs sharded, at 1
and 2 ranks, at the demo's checkpoint interval.

    python bench/checkpoint_overhead.py --json docs/results/checkpoint_overhead.json
    python bench/checkpoint_overhead.py --from docs/results/checkpoint_overhead.json   # the docs' table

Each run is `python -m vldist.train vsrn` (the demo's model and batch of 128 on shards/synth,
built on first use) for --steps steps under torchrun, with an epoch made long enough that no epoch
ends, no validation, a checkpoint every --every steps (the demo checkpoints at each epoch end:
every 40 steps), and always the final one. The baseline checkpoints only at the end. The run's
own `train_seconds` (metrics.json: from the start of training to the last committed checkpoint)
is the measure; the overhead is its excess over the baseline's at the same number of ranks,
median of --repeats runs each, the runs of one repeat interleaved so that drift hits every mode
alike. The stall is what one periodic save holds the step it follows: from metrics.jsonl (a
record per step), the gap between a save step's record and the next one, less the run's median
gap between records; the mean over the run's periodic saves, median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "none": [],
    "plain, synchronous": ["train.checkpoint_format=plain"],
    "plain, asynchronous": ["train.checkpoint_format=plain", "train.async_checkpoints=true"],
    "sharded, synchronous": ["train.checkpoint_format=sharded"],
    "sharded, asynchronous": ["train.checkpoint_format=sharded", "train.async_checkpoints=true"],
}


def run(ranks: int, mode: str, steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        save = [] if mode == "none" else [f"train.save_every_steps={every}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            "-m",
            "vldist.train",
            "vsrn",
            f"output.dir={out}",
            f"train.max_steps={steps}",
            "train.samples_per_epoch=1000000",
            "train.validate_every=0",
            "eval.baseline=false",
            "metrics.enabled=false",
            "train.keep_last=2",
            "train.log_every=1",
            *save,
            *MODES[mode],
        ]
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))},
        )
        if proc.returncode != 0:
            raise SystemExit(f"{mode} on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
        metrics = json.loads((Path(out) / "metrics.json").read_text())
        times = {
            r["step"]: r["time"]
            for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
            if r.get("event") == "train"
        }
        gaps = {step: times[step + 1] - times[step] for step in times if step + 1 in times}
        typical = statistics.median(gaps.values())
        saved = [] if mode == "none" else list(range(every, steps, every))
        stall = statistics.mean(gaps[s] - typical for s in saved) if saved else None
        return {
            "ranks": ranks,
            "mode": mode,
            "train_seconds": metrics["train_seconds"],
            "stall_seconds": stall,
            "step_seconds": typical,
        }


def table(results: dict) -> str:
    runs = results["runs"]
    lines = [
        f"| ranks | checkpoints | train seconds ({results['steps']} steps, median of {results['repeats']}) | "
        "overhead vs none | runs | stall per save (s) | median step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for ranks in sorted({r["ranks"] for r in runs}):
        base = statistics.median(r["train_seconds"] for r in runs if r["ranks"] == ranks and r["mode"] == "none")
        for mode in MODES:
            times = [r["train_seconds"] for r in runs if r["ranks"] == ranks and r["mode"] == mode]
            median = statistics.median(times)
            spread = ", ".join(f"{t:.1f}" for t in times)
            overhead = "-" if mode == "none" else f"{100 * (median - base) / base:+.1f}%"
            label = "only the final" if mode == "none" else f"every {results['every']} steps, {mode}"
            chosen = [r for r in runs if r["ranks"] == ranks and r["mode"] == mode]
            stalls = [r.get("stall_seconds") for r in chosen]  # runs before stalls were measured lack them
            stall = "-" if None in stalls else f"{statistics.median(stalls):.2f}"
            steps = [r.get("step_seconds") for r in chosen]
            step = "-" if None in steps else f"{statistics.median(steps):.3f}"
            lines.append(f"| {ranks} | {label} | {median:.1f} | {overhead} | {spread} | {stall} | {step} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument("--from", dest="source", type=Path, help="print the table of earlier runs")
    args = parser.parse_args()
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    runs = []
    for repeat in range(args.repeats):
        for ranks in args.ranks:
            for mode in MODES:
                runs.append(run(ranks, mode, args.steps, args.every))
                print(f"repeat {repeat + 1}: {ranks} ranks, {mode}: {runs[-1]['train_seconds']:.1f} s", flush=True)
    results = {
        "steps": args.steps,
        "every": args.every,
        "repeats": args.repeats,
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
