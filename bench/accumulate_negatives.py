"""What train.accumulate_negatives costs (training/negative_cache.py): the time of a VSRN step
against plain accumulation, and the largest global batch whose step fits a fixed memory budget
with every negative in the loss.

    flock /work/runs/cpu.lock python bench/accumulate_negatives.py --json docs/results/accumulate_negatives.json
    python bench/accumulate_negatives.py --from docs/results/accumulate_negatives.json   # the tables, no runs

Every step runs in a fresh subprocess (`--one`), one process, on the CPU with one thread (on a
shared 2-core machine two threads a process oversubscribe it: steps measured 10-30x slower):
a VSRN of the sizes below (the paper's 4 RRR layers, GRU reasoning and caption decoder, far
smaller than the paper's so that the series runs in minutes on 2 shared cores: 16 regions of 128
features, embed 64, decoder 64, words 32, a vocabulary of 500) on a synthetic global batch of
`batch` images and captions of 12 tokens, split into micro-batches of `micro`;
SGD, as the trainer's step does it: plain (Trainer._accumulate: each micro-batch's forward and
backward, its negatives its own) or cached (NegativeCache.accumulate), or the whole batch at once.

- time: at global batch --time-batch, one process per micro-batch size alternating plain and
  cached steps, --repeats of each after a warm-up round; the median and the range;
- memory: the child's peak resident set (ru_maxrss) after one step, with the batch's inputs (all
  its micro-batches, as the trainer holds them) and the model; the largest global batch of the
  doubling series from --min-batch to --max-batch whose step stays within --budget-mb, for the
  whole batch in one micro-batch (every negative, no accumulation) and cached (micro-batches of
  --memory-micro, every negative); and plain accumulation (the same micro-batches, each its own
  negatives) at the largest cached batch, for what the cache itself adds. A process that imports
  torch and builds the model already holds the `baseline`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = [
    "model.embed_size=64",
    "model.word_dim=32",
    "model.decoder_hidden=64",
    "model.decoder_dropout=0.1",
    "data.max_regions=16",
    "data.max_caption_len=14",
]
FEATURES, REGIONS, WORDS, CAPTION = 128, 16, 500, 12


def one_step(batch: int, micro: int, mode: str, repeats: int) -> dict:
    """In this process: `repeats` timed steps (after a warm-up when repeats > 1); peak RSS."""
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "tests" / "integration" / "workers"))
    from engines import cpu_engine

    from vldist.data.vocab import Vocab
    from vldist.distributed.collectives import global_sum
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe
    from vldist.training.negative_cache import NegativeCache

    n = batch // micro
    config = load_config("vsrn", [*SIZES, f"data.batch_size={batch}", f"train.grad_accumulation={n}"])
    recipe = VSRNRecipe(config, Vocab([f"w{i}" for i in range(WORDS)]), feature_dim=FEATURES)
    rng = np.random.default_rng(0)
    words = recipe.vocab.itos[4:]
    samples = [
        {
            "regions": rng.standard_normal((REGIONS, FEATURES)).astype(np.float32),
            "tokens": recipe.vocab.encode(" ".join(rng.choice(words, size=CAPTION - 2))),
        }
        for _ in range(batch)
    ]
    micro_batches = [recipe.collate_train(samples[k * micro : (k + 1) * micro]) for k in range(n)]
    del samples
    torch.manual_seed(0)
    engine = cpu_engine(config)
    module = recipe.build_model()
    model = engine.setup(module, {"main": torch.optim.SGD(module.parameters(), lr=1e-3)})
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def finite(losses, update):
        totals = global_sum(torch.stack([v.detach().float().reshape(()) for v in losses.values()]))
        return dict(zip(losses, totals.tolist(), strict=True))

    def plain() -> None:
        for i, b in enumerate(micro_batches):
            with engine.micro_batch(last=i == n - 1):
                losses = recipe.training_losses(model, b)
                finite(losses, "main")
                engine.backward(losses["loss"], n)

    cache = NegativeCache(recipe, engine)
    step = {"plain": plain, "whole": plain, "cached": lambda: cache.accumulate(model, micro_batches, "main", finite)}
    modes = ("plain", "cached") if mode == "both" else (mode,)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats + (1 if repeats > 1 else 0)):  # a warm-up round first, when timing
        for m in modes:  # alternating: a slower stretch of a shared machine hits both alike
            start = time.perf_counter()
            step[m]()
            engine.step("main", None)
            if repeats == 1 or r > 0:
                seconds[m].append(time.perf_counter() - start)
    return {
        "batch": batch,
        "micro": micro,
        "mode": mode,
        "seconds": seconds,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "baseline_mb": baseline,
    }


def in_child(batch: int, micro: int, mode: str, repeats: int = 1) -> dict:
    spec = json.dumps({"batch": batch, "micro": micro, "mode": mode, "repeats": repeats})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--one", spec], capture_output=True, text=True, env=env, cwd=REPO, timeout=1800
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args) -> dict:
    timing = []
    for micro in args.time_micro:
        run = in_child(args.time_batch, micro, "both", args.repeats)
        print(f"time: batch {args.time_batch}, micro {micro}: {run['seconds']}", flush=True)
        timing.append(run)
    memory = []
    for mode in ("whole", "cached"):
        batch = args.min_batch
        while batch <= args.max_batch:
            run = in_child(batch, batch if mode == "whole" else min(args.memory_micro, batch), mode)
            print(f"memory: batch {batch}, {mode}: {run['peak_mb']:.0f} MB", flush=True)
            memory.append(run)
            if run["peak_mb"] > args.budget_mb:
                break
            batch *= 2
    largest = max(r["batch"] for r in memory if r["mode"] == "cached" and r["peak_mb"] <= args.budget_mb)
    memory.append(in_child(largest, args.memory_micro, "plain"))  # what the cache itself adds
    print(f"memory: batch {largest}, plain: {memory[-1]['peak_mb']:.0f} MB", flush=True)
    import torch

    return {
        "machine": f"{os.cpu_count()}-core CPU VM, no GPU, torch {torch.__version__}",
        "python": platform.python_version(),
        "sizes": {"overrides": SIZES, "features": FEATURES, "regions": REGIONS, "vocab": WORDS, "caption": CAPTION},
        "budget_mb": args.budget_mb,
        "memory_micro": args.memory_micro,
        "time_batch": args.time_batch,
        "timing": timing,
        "memory": memory,
    }


def tables(results: dict) -> str:
    lines = [
        f"VSRN step on one process ({results['machine']}; embed 64, 16 regions of 128 features, "
        f"captions of 12 tokens), global batch {results['time_batch']}: seconds per step, median "
        "(min-max) of the repeats.",
        "",
        "| micro-batches | micro-batch | plain accumulation, s | accumulate_negatives, s | extra |",
        "|---|---|---|---|---|",
    ]
    for run in sorted(results["timing"], key=lambda r: -r["micro"]):
        micro, plain, cached = run["micro"], run["seconds"]["plain"], run["seconds"]["cached"]
        p, c = statistics.median(plain), statistics.median(cached)
        lines.append(
            f"| {results['time_batch'] // micro} | {micro} | {p:.2f} ({min(plain):.2f}-{max(plain):.2f}) | "
            f"{c:.2f} ({min(cached):.2f}-{max(cached):.2f}) | {100 * (c / p - 1):+.0f}% |"
        )
    budget = results["budget_mb"]
    lines += [
        "",
        f"Peak resident memory of one step (MB) by global batch, and the largest batch within {budget:,} MB "
        f"(micro-batches of {results['memory_micro']}; the process holds "
        f"{min(r['baseline_mb'] for r in results['memory']):.0f} MB before its first step: torch, the model and the "
        "smallest batch's inputs):",
        "",
    ]
    labels = {
        "whole": "whole batch, one micro-batch (every negative)",
        "plain": "plain accumulation (each micro-batch's negatives)",
        "cached": "accumulate_negatives (every negative)",
    }
    batches = sorted({r["batch"] for r in results["memory"]})
    lines.append("| | " + " | ".join(f"B {b}" for b in batches) + f" | largest B within {budget:,} MB |")
    lines.append("|---" * (len(batches) + 2) + "|")
    for mode, label in labels.items():
        peaks = {r["batch"]: r["peak_mb"] for r in results["memory"] if r["mode"] == mode}
        fits = [b for b, peak in peaks.items() if peak <= budget]
        cells = [f"{peaks[b]:,.0f}" if b in peaks else "" for b in batches]
        largest = max(fits) if fits else "none"
        if mode == "plain":
            largest = "(measured at the cached largest only)"
        elif fits and max(fits) == max(peaks) and max(peaks) == max(batches):
            largest = f"{largest} or more (the largest tried)"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {largest} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the tables of earlier results; no runs")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--time-batch", type=int, default=128)
    parser.add_argument("--time-micro", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-mb", type=int, default=1000)
    parser.add_argument("--memory-micro", type=int, default=64)
    parser.add_argument("--min-batch", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=1024)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_step(**json.loads(args.one))))
        return
    results = json.loads(args.source.read_text()) if args.source else measure(args)
    if args.json and not args.source:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(tables(results))


if __name__ == "__main__":
    main()
