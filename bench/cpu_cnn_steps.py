"""The CNN recipes' training steps on the CPU (L2C's two stages, LAViTeR's three phases), in fp32 and
under bf16 autocast, each with the convolutions in torch's default layout (NCHW) and channels-last
(NHWC): what `engine.mixed_precision=auto` and L2C's channels-last on CPU were chosen from
(docs/performance.md, "bf16 on the CPU").

    python bench/cpu_cnn_steps.py --json docs/results/cpu_cnn_steps.json
    python bench/cpu_cnn_steps.py --from docs/results/cpu_cnn_steps.json   # the table, nothing run

Per stage: a fresh model from the job's recipe and `--batches` real batches of its embedded set,
read before anything is timed and without loader workers, so that the step has the cores to
itself. One step is every update the recipe takes on a batch (LAViTeR's discriminator and main
updates), forward and backward, no optimizer. The four variants alternate round by round; the
median of the rounds' mean step time is reported, and the first batch's loss in each (bf16 moves
the numerics; the layout only the rounding). The model runs under `torch.autocast("cpu",
torch.bfloat16)` as it is, as the Accelerate engine runs it under bf16.
"""

from __future__ import annotations

import copy
import importlib
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

COMMAND = "python bench/cpu_cnn_steps.py"
STAGES = [("l2c", "cnn_lstm"), ("l2c", "l2c"), ("laviter", "vta"), ("laviter", "assist"), ("laviter", "joint")]
VARIANTS = ("fp32 NCHW", "fp32 NHWC", "bf16 NCHW", "bf16 NHWC")


def stage_models(job: str, stage: str, batches: int):
    """The stage's recipe, its model in both layouts (the same initial weights) and `batches` batches."""
    from loader_cpu import stage_batches

    recipe, taken = stage_batches(job, stage, batches, ["train.device=cpu"])
    # the recipe's own layout choice set aside: the bench builds the default layout, then converts a copy
    module = importlib.import_module(type(recipe).__module__)
    chosen = module.channels_last_wanted
    module.channels_last_wanted = lambda *args, **kwargs: False
    try:
        torch.manual_seed(0)
        nchw = recipe.build_model().train()
    finally:
        module.channels_last_wanted = chosen
    return recipe, {"NCHW": nchw, "NHWC": copy.deepcopy(nchw).use_channels_last()}, taken


def step(recipe, model, batch: dict, index: int, bf16: bool) -> float:
    """Every update of the recipe's step `index` on the batch, forward and backward; the summed loss."""
    recipe.start_step(index)
    total = 0.0
    for update in recipe.updates(index):
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = recipe.training_losses(model, batch, update)["loss"]
        loss.backward()
        total += float(loss.detach())
    model.zero_grad(set_to_none=True)
    return total


def measure_stage(job: str, stage: str, rounds: int, batches: int) -> dict:
    recipe, models, taken = stage_models(job, stage, batches)
    recipe.start_epoch(0)

    def run(variant: str, batch: dict, index: int) -> float:
        precision, layout = variant.split()
        return step(recipe, models[layout], batch, index, precision == "bf16")

    first_loss = {v: run(v, taken[0], 0) for v in VARIANTS}  # also a warm-up
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            start = time.perf_counter()
            for index, batch in enumerate(taken):
                run(variant, batch, index)
            times[variant].append((time.perf_counter() - start) / len(taken))
    return {
        "job": job,
        "stage": stage,
        "ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "first_loss": first_loss,
    }


def table(results: dict) -> str:
    from cpu_bf16 import header

    lines = [
        *header(
            results,
            f"{results['rounds']} rounds alternating, medians of the rounds' mean step over {results['batches']} batches",
        ),
        "",
        "| job: stage | " + " | ".join(f"{v} ms" for v in VARIANTS) + " | best vs fp32 NCHW | first loss fp32 / bf16 |",
        "|---|" + "---|" * (len(VARIANTS) + 2),
    ]
    for row in results["rows"]:
        ms, loss = row["ms"], row["first_loss"]
        best = min(VARIANTS, key=ms.get)
        lines.append(
            f"| {row['job']}: {row['stage']} | "
            + " | ".join(f"{ms[v]:.0f}" for v in VARIANTS)
            + f" | {best}, x{ms['fp32 NCHW'] / ms[best]:.2f} | {loss['fp32 NCHW']:.4f} / {loss['bf16 NCHW']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    from cpu_bf16 import step_bench_arguments, write_and_print

    parser = step_bench_arguments(__doc__, rounds=3, batches=3)
    parser.add_argument("--stages", nargs="+", default=[f"{j}:{s}" for j, s in STAGES], help="job:stage ...")
    args = parser.parse_args()
    if args.from_file:
        print(table(json.loads(args.from_file.read_text())), end="")
        return
    rows = []
    for job, stage in (s.split(":") for s in args.stages):
        rows.append(measure_stage(job, stage, args.rounds, args.batches))
        print(f"{job}: {stage} " + ", ".join(f"{v} {ms:.0f} ms" for v, ms in rows[-1]["ms"].items()), flush=True)
    write_and_print(args, COMMAND, {"rows": rows}, table)


if __name__ == "__main__":
    main()
