"""Dropout on the CPU: torch's `F.dropout` (its mask from `bernoulli_`) against vldist's
(`models/dropout.py`: the mask from one `torch.rand` draw), forward and backward, at the shapes the
demos drop out in a training step.

    python bench/cpu_dropout.py --json docs/results/cpu_dropout.json
    python bench/cpu_dropout.py --from docs/results/cpu_dropout.json   # the table, nothing run

Two tables, each implementation alternating with the other round by round, medians:

- the dropout alone: `--batches` calls a round (an fp32 tensor that needs a gradient, dropped out,
  then the backward of its sum) at the shapes the demos drop out: VSRN's decoder its hidden states
  (caption tokens x batch x hidden; the demo's captions run up to about 27 tokens), the captioners
  their readout (images x captions, tokens, hidden), the two-branch retrieval stage its branches'
  hidden layers (images and sentences, hidden);
- whole training steps (the recipe's losses and backward, fp32, no optimizer) on 5 real batches of
  a demo job's stage, read first without loader workers, with every dropout module of the model
  torch's `nn.Dropout` and then vldist's `Dropout` (what the trainer swaps in).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_bf16 import header, step_bench_main  # noqa: E402
from loader_cpu import stage_batches  # noqa: E402

from vldist.models.dropout import Dropout, dropout, replace_dropout  # noqa: E402

COMMAND = "python bench/cpu_dropout.py"
CASES = {
    "vsrn decoder": ((25, 128, 256), 0.1),
    "captioner readout": ((64 * 5, 19, 256), 0.5),
    "two-branch branches": ((250 + 500, 1024), 0.5),
}
IMPLEMENTATIONS = {"F.dropout": F.dropout, "vldist": dropout}
STEP_CASES = {"vsrn": "", "captioner": "", "two_branch_embed": "retrieval", "laviter": "joint"}
MODULES = {"F.dropout": nn.Dropout, "vldist": Dropout}
STEP_BATCHES = 5  # batches a round in the steps' table (LAViTeR's joint step takes about a second)


def _call(function, x: torch.Tensor, p: float) -> float:
    start = time.perf_counter()
    function(x, p, True).sum().backward()
    return time.perf_counter() - start


def _step(recipe, model: nn.Module, batch: dict) -> float:
    start = time.perf_counter()
    losses = recipe.training_losses(model, batch)
    (losses["loss"] if "loss" in losses else sum(losses.values())).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure_steps(rounds: int, batches: int) -> list[dict]:
    rows = []
    for job, stage in STEP_CASES.items():
        recipe, taken = stage_batches(job, stage, batches)
        torch.manual_seed(0)
        model = recipe.build_model().train()
        times = {impl: [] for impl in MODULES}
        for kind in MODULES.values():
            modules = replace_dropout(model, lambda m, kind=kind: kind(m.p))
            _step(recipe, model, taken[0])  # warm-up
        for _ in range(rounds):
            for impl, kind in MODULES.items():
                replace_dropout(model, lambda m, kind=kind: kind(m.p))
                times[impl] += [_step(recipe, model, batch) for batch in taken]
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        rows.append({"job": job, "stage": stage, "dropout_modules": modules, "ms": ms})
        print(f"{job} {stage}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), file=sys.stderr)
    return rows


def measure(rounds: int, calls: int) -> dict:
    return {"calls": measure_calls(rounds, calls), "steps": measure_steps(rounds, STEP_BATCHES)}


def measure_calls(rounds: int, calls: int) -> list[dict]:
    rows = []
    for name, (shape, p) in CASES.items():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).requires_grad_()
        times = {impl: [] for impl in IMPLEMENTATIONS}
        for function in IMPLEMENTATIONS.values():
            _call(function, x, p)  # warm-up
        for _ in range(rounds):
            for impl, function in IMPLEMENTATIONS.items():
                times[impl] += [_call(function, x, p) for _ in range(calls)]
        rows.append(
            {
                "case": name,
                "shape": list(shape),
                "p": p,
                "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            }
        )
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in rows[-1]["ms"].items()), file=sys.stderr)
    return rows


def _speed_rows(rows: list[dict], first: Callable[[dict], tuple], digits: int) -> list[str]:
    """Table rows: `first(row)`'s columns, then torch's and vldist's ms and the speed-up."""
    lines = []
    for row in rows:
        torch_ms, ours = row["ms"]["F.dropout"], row["ms"]["vldist"]
        cells = [*first(row), f"{torch_ms:.{digits}f}", f"{ours:.{digits}f}", f"x{torch_ms / ours:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def table(results: dict) -> str:
    measured = results["results"]
    return (
        "\n".join(
            [
                *header(
                    results,
                    f"{results['rounds']} rounds alternating of {results['batches']} calls / {STEP_BATCHES} steps each, medians",
                ),
                "",
                "| case | shape | p | F.dropout ms | vldist ms | speed-up |",
                "|---|---|---|---|---|---|",
                *_speed_rows(measured["calls"], lambda r: (r["case"], " x ".join(map(str, r["shape"])), r["p"]), 2),
                "",
                "| job | stage | dropout modules | step ms, nn.Dropout | step ms, vldist | speed-up |",
                "|---|---|---|---|---|---|",
                *_speed_rows(measured["steps"], lambda r: (r["job"], r["stage"] or "-", r["dropout_modules"]), 1),
            ]
        )
        + "\n"
    )


def main() -> None:
    step_bench_main(__doc__, COMMAND, 5, 10, measure, table)


if __name__ == "__main__":
    main()
