"""VSRN's ablation (the paper's Table 4) in miniature, on the embedded synthetic scenes.

    python bench/vsrn_ablation.py [--root runs/vsrn_ablation] [--seeds 0 1 2] [--rows gsr full]

Trains the demo job (jobs/vsrn.yaml, 600 steps) once per row and seed, each as its own
`python -m vldist.train vsrn ... output.dir=<root>/<row>/seed<k>` process:

    mean-pool   Mean-pool baseline       model.rrr_layers=0 model.global_reasoning=mean
    gsr         GSR only (0 RRR layers)  model.rrr_layers=0
    gsr-star    4RRR + GSR*              model.caption_loss=false   (no generation loss L_G)
    full        4RRR + GSR               the demo's defaults

A run whose metrics.json exists is not run again, so an interrupted bench resumes where it
stopped. Then prints a markdown table (mean ± sample std over seeds of the test recalls and rsum,
and each seed's rsum) and writes it with the raw numbers to <root>/ablation.json. Each run's log
is <root>/<row>/seed<k>/train.log. On a 2-core CPU a run takes about 4-6 minutes, so the 12 runs
of the default take about an hour; `--steps 5` makes a quick smoke run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ablation_runs import ablation_parser, markdown_table, mean_std, train_once

# (key, label, overrides): in the paper's order, weakest first
ROWS = [
    ("mean-pool", "Mean-pool", ["model.rrr_layers=0", "model.global_reasoning=mean"]),
    ("gsr", "GSR", ["model.rrr_layers=0"]),
    ("gsr-star", "4RRR + GSR*", ["model.caption_loss=false"]),
    ("full", "4RRR + GSR", []),
]
# (metrics.json key, column): R@1s and rsum first, R@5/R@10 after
COLUMNS = [("i2t_r1", "i2t R@1"), ("t2i_r1", "t2i R@1"), ("rsum", "rsum"),
           ("i2t_r5", "i2t R@5"), ("i2t_r10", "i2t R@10"), ("t2i_r5", "t2i R@5"), ("t2i_r10", "t2i R@10")]


def run(run_dir: Path, overrides: list[str], seed: int, args: argparse.Namespace) -> tuple[dict, float | None]:
    """Train one (row, seed) in a fresh process (kept if it finished before)."""
    argv = [*overrides, f"seed={seed}", "eval.baseline=false", "metrics.enabled=false"]
    if args.steps is not None:
        argv.append(f"train.max_steps={args.steps}")
    if args.shards is not None:
        argv.append(f"data.shards={args.shards}")
    return train_once("vsrn", run_dir, argv)


def table(results: dict, seeds: list[int]) -> str:
    head = ["row", *(name for _, name in COLUMNS), "rsum per seed"]
    rows = []
    for label, runs in results.items():
        cells = [mean_std([runs[s]["test"][key] for s in seeds]) for key, _ in COLUMNS]
        per_seed = " / ".join(f"{runs[s]['test']['rsum']:.1f}" for s in seeds)
        rows.append([label, *cells, per_seed])
    return markdown_table(head, rows)


def main() -> None:
    parser = ablation_parser(__doc__, "vsrn_ablation", [key for key, _, _ in ROWS])
    parser.add_argument("--steps", type=int, help="train.max_steps (default: the job's 600), for a smoke run")
    parser.add_argument("--shards", help="data.shards (default: the job's shards/synth, built on first use)")
    args = parser.parse_args()
    root = args.root.resolve()

    results, raw = {}, {}
    for key, label, overrides in ROWS:
        if key not in args.rows:
            continue
        results[label], raw[key] = {}, {"label": label, "overrides": overrides, "seeds": {}}
        for seed in args.seeds:
            metrics, seconds = run(root / key / f"seed{seed}", overrides, seed, args)
            results[label][seed] = {"test": metrics["test"]["full"]}
            raw[key]["seeds"][seed] = {"test": metrics["test"]["full"], "steps": metrics["steps"],
                                       "best_epoch": metrics["best_epoch"], "process_seconds": seconds,
                                       "trainer_wall_seconds": metrics["wall_seconds"]}
            took = "kept" if seconds is None else f"{seconds:.0f} s"
            print(f"{label}, seed {seed}: rsum {metrics['test']['full']['rsum']:.1f} ({took})", flush=True)

    text = table(results, args.seeds)
    print("\n" + text)
    (root / "ablation.json").write_text(json.dumps({"table": text, "seeds": args.seeds, "rows": raw}, indent=2) + "\n")
    print(f"\n{root / 'ablation.json'}")


if __name__ == "__main__":
    main()
