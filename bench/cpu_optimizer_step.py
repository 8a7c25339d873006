"""One Adam step on the CPU, torch's per-parameter loop against its fused kernel (torch 2.4 and
later), over VSRN's parameters at the demo's and the paper's sizes (bench/vs_official.py's models).

    python bench/cpu_optimizer_step.py --json docs/results/cpu_optimizer_step.json
    python bench/cpu_optimizer_step.py --from docs/results/cpu_optimizer_step.json   # the table, nothing run

Every parameter gets a random gradient once; then, round by round, each implementation takes
`--batches` steps on its own copy of the optimizer state (one step first, not timed, creates the
state), alternating. The median of all timed steps per implementation. Under the Accelerate engine
vldist's optimizers are the fused ones on CPU as on CUDA (training/optimizers.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_bf16 import header, step_bench_main  # noqa: E402
from vs_official import SIZES, VldistStep  # noqa: E402

COMMAND = "python bench/cpu_optimizer_step.py"
IMPLEMENTATIONS = {"per-parameter": {"foreach": False}, "fused": {"fused": True}}


def measure(rounds: int, steps: int) -> list[dict]:
    rows = []
    for size in ("demo", "paper"):
        params = list(VldistStep(SIZES[size]).model.parameters())
        generator = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizers = {name: torch.optim.Adam(params, lr=1e-4, **flags) for name, flags in IMPLEMENTATIONS.items()}
        for optimizer in optimizers.values():
            optimizer.step()  # creates the state
        times = {name: [] for name in optimizers}
        for _ in range(rounds):
            for name, optimizer in optimizers.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    optimizer.step()
                    times[name].append(time.perf_counter() - start)
        rows.append(
            {
                "size": size,
                "tensors": len(params),
                "parameters": sum(p.numel() for p in params),
                "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            }
        )
        print(f"{size}: " + ", ".join(f"{n} {v:.2f} ms" for n, v in rows[-1]["ms"].items()), file=sys.stderr)
    return rows


def table(results: dict) -> str:
    lines = [
        *header(results, f"{results['rounds']} rounds alternating of {results['batches']} steps each, medians"),
        "",
        "| sizes | parameter tensors | parameters | per-parameter ms | fused ms | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["results"]:
        loop, fused = row["ms"]["per-parameter"], row["ms"]["fused"]
        lines.append(
            f"| {row['size']} | {row['tensors']} | {row['parameters']:,} | {loop:.2f} | {fused:.2f} | x{loop / fused:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    step_bench_main(__doc__, COMMAND, 5, 5, measure, table)


if __name__ == "__main__":
    main()
