"""bf16 on the CPU's matrix units (AMX) for the two-branch embedding network's phrase stage: the
stage the embedding demo spends most of its time in, whose steps are GEMM-bound in fp32
(docs/performance.md, "Why the embedding network's demo cannot reach half").

    python bench/cpu_bf16.py --json docs/results/cpu_bf16.json
    python bench/cpu_bf16.py --from docs/results/cpu_bf16.json   # the tables, nothing run

Two measurements, each mode alternating with the other round by round, medians:

- the stage's largest GEMM, F.linear forward and backward (the weight's gradient; the rows are
  region features, which need none) at a batch's rows x 2,048 -> 1,024: fp32; bf16 tensors; and
  fp32 tensors cast to bf16 first, as torch.autocast does;
- the stage's whole training step (the recipe's loss on real batches of the embedded set, backward)
  in fp32 and under `torch.autocast("cpu", torch.bfloat16)`, with torch.profiler's self CPU time
  of the GEMMs (aten::mm, aten::addmm) and of the casts (aten::copy_) over one step of each, and
  the first batch's loss in both (the numerics moved).

The batches are read before anything is timed, without loader workers, so that the step has the
cores to itself. The model runs under `torch.autocast` as it is, not through the Accelerate engine
(which returns the model's outputs in fp32), so its embeddings reach the loss in bf16; the losses
compute in fp32 either way (`losses/precision.py`). In training, `engine.mixed_precision=bf16` is
this autocast on CPU (the Accelerate engine; the default is fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

COMMAND = "python bench/cpu_bf16.py"
GEMM_MODES = ("fp32", "bf16", "fp32 cast to bf16")
STEP_MODES = ("fp32", "bf16 autocast")


def gemm_seconds(rows: int, mode: str, repeats: int = 3) -> float:
    """F.linear rows x 2048 -> 1024, forward and the weight's gradient; the median of `repeats`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 2048, generator=g)
    weight = torch.randn(1024, 2048, generator=g).mul_(0.02).requires_grad_()
    upstream = torch.randn(rows, 1024, generator=g)
    if mode == "bf16":
        x, upstream = x.bfloat16(), upstream.bfloat16()
        weight = weight.detach().bfloat16().requires_grad_()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if mode == "fp32 cast to bf16":
            out = F.linear(x.bfloat16(), weight.bfloat16())
            out.backward(upstream.bfloat16())
        else:
            F.linear(x, weight).backward(upstream)
        times.append(time.perf_counter() - start)
        weight.grad = None
    return statistics.median(times[1:])


def phrase_stage(batches: int):
    """The embedding demo's phrase stage: its recipe, a fresh model and `batches` real batches."""
    from loader_cpu import stage_batches

    recipe, taken = stage_batches("two_branch_embed", "phrases", batches)
    torch.manual_seed(0)
    return recipe, recipe.build_model().train(), taken


def step(recipe, model, batch: dict, mode: str) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16 autocast" else nullcontext():
        loss = recipe.training_losses(model, batch)["loss"]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def profile_step(recipe, model, batch: dict, mode: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(recipe, model, batch, mode)
    self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return {
        "gemm_ms": self_ms.get("aten::mm", 0.0) + self_ms.get("aten::addmm", 0.0),
        "copy_ms": self_ms.get("aten::copy_", 0.0),
        "total_ms": sum(self_ms.values()),
    }


def measure(rounds: int, batches: int) -> dict:
    recipe, model, taken = phrase_stage(batches)
    rows = statistics.median(int(b["images"].shape[0]) for b in taken)
    gemm = {mode: [] for mode in GEMM_MODES}
    steps = {mode: [] for mode in STEP_MODES}
    first_loss = {mode: step(recipe, model, taken[0], mode) for mode in STEP_MODES}  # also a warm-up
    for _ in range(rounds):
        for mode in GEMM_MODES:
            gemm[mode].append(gemm_seconds(int(rows), mode))
        for mode in STEP_MODES:
            start = time.perf_counter()
            for batch in taken:
                step(recipe, model, batch, mode)
            steps[mode].append((time.perf_counter() - start) / len(taken))
    flop = 2 * 2 * rows * 2048 * 1024  # forward and the weight's gradient
    return {
        "rows": rows,
        "gemm": {
            m: {"ms": 1e3 * statistics.median(v), "gflops": flop / statistics.median(v) / 1e9} for m, v in gemm.items()
        },
        "step": {
            m: {"ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "max_ms": 1e3 * max(v)}
            for m, v in steps.items()
        },
        "profile": {mode: profile_step(recipe, model, taken[1], mode) for mode in STEP_MODES},
        "first_loss": first_loss,
    }


def table(results: dict) -> str:
    m, r = results["machine"], results["results"]
    base_gemm, base_step = r["gemm"]["fp32"]["ms"], r["step"]["fp32"]["ms"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']}; "
        f"{results['rounds']} rounds alternating, medians; {results['batches']} batches of the embedded set's "
        f"phrase stage, {r['rows']:.0f} region rows a batch (median)",
        "",
        f"`{results['command']}`",
        "",
        f"| F.linear {r['rows']:.0f} x 2048 -> 1024, forward and weight gradient | ms | GFLOP/s | vs fp32 |",
        "|---|---|---|---|",
    ]
    for mode, row in r["gemm"].items():
        lines.append(f"| {mode} | {row['ms']:.1f} | {row['gflops']:.0f} | x{base_gemm / row['ms']:.2f} |")
    lines += [
        "",
        "| phrase-stage step (loss and backward) | ms (min-max) | vs fp32 | GEMMs' self ms | casts' self ms "
        "| every operator's self ms | first batch's loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, row in r["step"].items():
        p = r["profile"][mode]
        lines.append(
            f"| {mode} | {row['ms']:.0f} ({row['min_ms']:.0f}-{row['max_ms']:.0f}) | x{base_step / row['ms']:.2f} "
            f"| {p['gemm_ms']:.0f} | {p['copy_ms']:.0f} | {p['total_ms']:.0f} | {r['first_loss'][mode]:.4f} |"
        )
    return "\n".join(lines) + "\n"


def step_bench_arguments(description: str, rounds: int, batches: int) -> argparse.ArgumentParser:
    """The command line of the benches that time steps on real batches (this one, cpu_cnn_steps.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batches", type=int, default=batches, help="batches per round and mode")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="from_file", type=Path, help="print the tables of a results file; run nothing")
    return parser


def write_and_print(args, command: str, measured: dict, table) -> None:
    """The results with the machine and the command, written to --json and printed as `table` prints them."""
    from demo_times import machine

    results = {
        "machine": machine(),
        "command": " ".join([command, *sys.argv[1:]]),
        "rounds": args.rounds,
        "batches": args.batches,
        **measured,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results), end="")


def header(results: dict, how: str) -> list[str]:
    """A step bench table's first lines: the machine, how it was measured, the command."""
    m = results["machine"]
    return [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']}; {how}",
        "",
        f"`{results['command']}`",
    ]


def step_bench_main(description: str, command: str, rounds: int, batches: int, measure, table) -> None:
    """A step bench's command line: --from prints a results file's tables; otherwise measure(rounds,
    batches) runs and its results are written (--json) and printed."""
    args = step_bench_arguments(description, rounds, batches).parse_args()
    if args.from_file:
        print(table(json.loads(args.from_file.read_text())), end="")
        return
    write_and_print(args, command, {"results": measure(args.rounds, args.batches)}, table)


def main() -> None:
    step_bench_main(__doc__, COMMAND, 5, 4, measure, table)


if __name__ == "__main__":
    main()
