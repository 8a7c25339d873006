"""What the replica check costs (train.replica_check_every): one check of the demo job's VSRN on 2
gloo ranks, against the demo's training step on the same 2 ranks.

    python bench/replica_check.py --json docs/results/replica_check.json
    python bench/replica_check.py --from docs/results/replica_check.json     # the docs' table

check  ReplicaCheck.check on the demo model (jobs/vsrn.yaml, shards/synth: built on first use),
       median of --repeats after one warm-up: every replicated tensor hashed, the hashes
       all-gathered, compared; each rank one thread
step   one training step of the demo job (global batch 128) on 2 torchrun ranks, from the last
       progress window of --steps steps (bench/global_negatives.py's measure_step)
The share at an interval N is check / (N x step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
INTERVALS = (1, 10, 100, 1000)


def worker(repeats: int, out: Path) -> None:
    """Under torchrun: the demo model built as the trainer builds it, and the check timed."""
    import torch
    import torch.distributed as dist

    from vldist.data.shardset import ShardSet
    from vldist.distributed.replicas import ReplicaCheck, replicated_tensors
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = load_config("vsrn", [])
    shards = ShardSet.open(config.data.shards)
    vocab = shards.vocab(Path(tempfile.mkdtemp()), config.data.vocab_min_count)
    torch.manual_seed(config.seed)
    model = get_recipe("vsrn")(config, vocab, shards.feature_dim()).build_model()
    check = ReplicaCheck(model, dist.get_world_size(), 1, config.engine.sync_batchnorm)
    times = []
    for step in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        check.check(step + 1)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        tensors = replicated_tensors(model, config.engine.sync_batchnorm)
        out.write_text(
            json.dumps(
                {
                    "check_ms": 1e3 * statistics.median(times[1:]),
                    "tensors": len(tensors),
                    "values": sum(t.numel() for _, t in tensors),
                }
            )
        )
    dist.destroy_process_group()


def measure(repeats: int, steps: int) -> dict:
    from global_negatives import measure_step

    from vldist.data.job_shards import build_missing
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    os.chdir(ROOT)
    build_missing(load_config("vsrn", []), get_recipe("vsrn"))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "check.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                __file__,
                "--worker",
                str(out),
                "--repeats",
                str(repeats),
            ],
            check=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        result = json.loads(out.read_text())
    result["step_ms"] = 1e3 * measure_step(2, 64, steps)
    result["share"] = {str(n): result["check_ms"] / (n * result["step_ms"]) for n in INTERVALS}
    return result


def table(result: dict) -> str:
    lines = [
        "| tensors compared | values hashed | one check | demo step (2 ranks) | "
        + " | ".join(f"share, every {n}" for n in INTERVALS)
        + " |",
        "|---" * (4 + len(INTERVALS)) + "|",
    ]
    shares = " | ".join(f"{100 * result['share'][str(n)]:.2f}%" for n in INTERVALS)
    lines.append(
        f"| {result['tensors']} | {result['values'] / 1e6:.1f} M | {result['check_ms']:.1f} ms | "
        f"{result['step_ms']:.0f} ms | {shares} |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from", dest="source", type=Path, help="print the docs' table from saved results")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats, args.worker)
        return
    result = json.loads(args.source.read_text()) if args.source else measure(args.repeats, args.steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
