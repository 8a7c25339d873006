"""What train.activation_checkpointing costs and saves per recipe: the peak memory of one training
step and the step's time, with the recipe's blocks checkpointed and without.

    python bench/activation_checkpointing.py --json docs/results/activation_checkpointing.json  # ~8 min on 2 cores
    python bench/activation_checkpointing.py --cases vsrn l2c --steps 2                          # some cases
    python bench/activation_checkpointing.py --from docs/results/activation_checkpointing.json   # the table, no runs

The bench builds small embedded sets in a temporary directory (build_synth: 128 scenes; build_synth_pairs:
32 pairs) and takes each case's first batch of training samples (repeated to the batch size). Each
(case, checkpointing) runs in a fresh subprocess, which builds the recipe's model (the job's own
sizes unless the case says otherwise), takes one warm-up step (every update of the recipe's first
step: forward, backward, Adam step; the optimizer's state is allocated there), and then:

- peak memory: the resident set's increase over one more step, from the process's resident size
  before it to its high-water mark during it (the mark reset just before: /proc/self/clear_refs).
  The subprocess runs with MALLOC_MMAP_THRESHOLD_=131072, so that glibc serves every large block
  by mmap and gives it back on free: the resident size then follows the tensors alive;
- step time: the median of --steps further steps (wall clock, --threads torch threads: 1 by
  default, which a machine shared with other work disturbs least).

On CUDA (--device cuda) the memory is torch.cuda.max_memory_allocated's increase over the step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# case -> (job, set, rows of the batch, overrides): the demo jobs' models (VSRN with 36 padded
# regions, as the paper's features have), at batch sizes a 2-core CPU steps in seconds
CASES = {
    "vsrn": ("vsrn", "synth", 32, ["data.max_regions=36"]),
    "captioner": ("captioner", "synth", 32, []),
    "cl_caption": ("cl_caption", "synth", 16, ["model.init_from=unused"]),
    "two_branch_embed": ("two_branch_embed", "synth", 128, ["model.tasks=[retrieval]"]),
    "two_branch_sim": ("two_branch_sim", "synth", 128, ["model.tasks=[retrieval]"]),
    "l2c": ("l2c", "pairs", 8, []),
    "laviter": ("laviter", "synth", 16, ["model.phase=joint"]),
}


def recipe_and_batch(name: str, shards, overrides: list[str], rows: int = 4):
    """Recipe `name` on a shard set, and a training batch of its first `rows` train samples
    (repeated when the split has fewer), as its first training stream reads them."""
    import webdataset as wds

    from vldist.data.shardset import ShardSet
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    config = load_config(name, [f"data.shards={shards}", *overrides])
    opened = ShardSet.open(shards)
    recipe = get_recipe(name)(config, opened.vocab(Path(shards)), opened.feature_dim())
    raws = list(wds.tarfile_samples({"url": u} for u in opened.urls("train")))
    sample, collate = recipe.stream_functions(next(iter(recipe.train_streams(config))))
    return recipe, collate([sample(raw, random.Random(i)) for i, raw in enumerate(islice(cycle(raws), rows))])


# ---------------------------------------------------------------- one case, in its own process


def _resident_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(case: str, shards: str, checkpointing: bool, steps: int, device: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from vldist.training.activation_checkpointing import checkpoint_blocks

    job, _, rows, overrides = CASES[case]
    recipe, batch = recipe_and_batch(job, shards, overrides, rows)
    torch.manual_seed(0)
    model = recipe.build_model().to(device).train()
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    blocks = checkpoint_blocks(model, recipe.checkpointed_blocks(model)) if checkpointing else []
    optimizers = {n: torch.optim.Adam(p, lr=1e-4) for n, p in recipe.optimizer_groups(model).items()}

    def step():
        recipe.start_step(0)
        for update in recipe.updates(0):
            model.zero_grad(set_to_none=True)
            recipe.training_losses(model, batch, update)["loss"].backward()
            optimizers[update].step()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: the optimizers' state
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _resident_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
        step()
        peak_mb = (_resident_kb("VmHWM") - before) / 1024
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "blocks": blocks,
        "rows": rows,
        "parameters_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "peak_mb": peak_mb,
        "step_s": statistics.median(times),
    }


# ---------------------------------------------------------------- the runs and the table


def build_sets(directory: Path) -> dict[str, str]:
    from vldist.shards.synthetic.pairs import build_synth_pairs
    from vldist.shards.synthetic.synth import build_synth

    sets = {"synth": directory / "synth", "pairs": directory / "pairs"}
    if not (sets["synth"] / "manifest.json").is_file():
        build_synth(sets["synth"], n_train=128, n_val=8, n_test=8, shard_size=64, progress=False, overwrite=True)
    if not (sets["pairs"] / "manifest.json").is_file():
        build_synth_pairs(sets["pairs"], n_train=32, n_val=8, n_test=8, shard_size=32, progress=False, overwrite=True)
    return {k: str(v) for k, v in sets.items()}


def run_case(case: str, shards: str, checkpointing: bool, steps: int, device: str, threads: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--one", case, shards, str(int(checkpointing)), str(steps), device, str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{case} (checkpointing {checkpointing}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    lines = [
        f"Activation checkpointing, one training step per recipe ({results['machine']}, "
        f"{results['threads']} torch thread(s); peak: {results['memory']}; step: median of {results['steps']}; "
        "`python bench/activation_checkpointing.py`)",
        "",
        "| recipe | batch | checkpointed blocks | weights MB | peak MB off | peak MB on | memory saved "
        "| step s off | step s on | time added |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, row in results["cases"].items():
        off, on = row["off"], row["on"]
        blocks = ", ".join(on["blocks"])
        if len(blocks) > 60:
            blocks = f"{len(on['blocks'])} blocks"
        lines.append(
            f"| {case} | {on['rows']} | {blocks} | {on['parameters_mb']:.0f} | {off['peak_mb']:.0f} "
            f"| {on['peak_mb']:.0f} | {1 - on['peak_mb'] / off['peak_mb']:.0%} | {off['step_s']:.3f} "
            f"| {on['step_s']:.3f} | {on['step_s'] / off['step_s'] - 1:+.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (the median is kept)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--sets", type=Path, help="keep the built sets here (built when missing; default: a temporary dir)"
    )
    parser.add_argument("--from", dest="source", type=Path, help="print the table of earlier results; no runs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier timings on a machine shared with other work)"
    )
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # a subprocess's own case
    args = parser.parse_args()
    if args.one:
        case, shards, checkpointing, steps, device, threads = args.one
        print(json.dumps(measure(case, shards, checkpointing == "1", int(steps), device, int(threads))))
        return
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    import torch

    cpu = f"{os.cpu_count()}-core CPU VM, no GPU" if args.device == "cpu" else torch.cuda.get_device_name()
    results = {
        "machine": f"{cpu}, torch {torch.__version__.split('+')[0]}",
        "platform": platform.platform(),
        "memory": "CUDA max_memory_allocated increase"
        if args.device == "cuda"
        else "resident-set increase over the step, fresh process",
        "steps": args.steps,
        "threads": args.threads,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        sets = build_sets(args.sets or Path(tmp))
        print(f"sets built in {time.perf_counter() - start:.0f} s", flush=True)
        for case in args.cases:
            shards = sets[CASES[case][1]]
            row = {
                mode: run_case(case, shards, mode == "on", args.steps, args.device, args.threads)
                for mode in ("off", "on")
            }
            results["cases"][case] = row
            print(f"{case}: {row}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
