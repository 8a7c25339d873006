"""VSRN's ablation (the paper's Table 4) in miniature, on the embedded synthetic scenes.

    python bench/vsrn_ablation.py [--root runs/vsrn_ablation] [--seeds 0 1 2] [--rows gsr full]
                                  [--results docs/results/vsrn_ablation.json]
    python bench/vsrn_ablation.py --from docs/results/vsrn_ablation.json    # the tables, no training

Trains the demo job (jobs/vsrn.yaml, 600 steps) once per row and seed, each as its own
`python -m vldist.train vsrn ... output.dir=<root>/<row>/seed<k>` process:

    mean-pool   Mean-pool baseline       model.rrr_layers=0 model.global_reasoning=mean
    gsr         GSR only (0 RRR layers)  model.rrr_layers=0
    gsr-star    4RRR + GSR*              model.caption_loss=false   (no generation loss L_G)
    full        4RRR + GSR               the demo's defaults
    full-token  4RRR + GSR, L_G averaged over tokens instead of summed per caption (not in the paper)

A run whose metrics.json exists is not run again, so an interrupted bench resumes where it
stopped, and a second invocation with the same seeds regenerates the results without training.
Then writes each run's test recalls, rsum, best epoch and seconds to --results (committed as
docs/results/vsrn_ablation.json) and prints two markdown tables (mean ± sample std over seeds,
each seed's rsum, the paper's Table 4 beside them; see bench/ablation_runs.py), also written
with the numbers to <root>/ablation.json. Each run's log is <root>/<row>/seed<k>/train.log. On a
2-core CPU a run takes about 4-6 minutes, so the 15 runs of the default take about 75 minutes;
`--steps 5` makes a quick smoke run (give it its own --results).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ablation_runs import (
    Col,
    Recorder,
    Row,
    ablation_table,
    bench_main,
    blocks,
    neighbours,
    paper_columns,
    paper_sum,
    pick,
    spread_line,
    train_once,
)

# in the paper's order, weakest first
ROWS = [
    Row("mean-pool", "Mean-pool", "vsrn", ["model.rrr_layers=0", "model.global_reasoning=mean"]),
    Row("gsr", "GSR", "vsrn", ["model.rrr_layers=0"]),
    Row("gsr-star", "4RRR + GSR*", "vsrn", ["model.caption_loss=false"]),
    Row("full", "4RRR + GSR", "vsrn", []),
    # not in the paper: L_G as a mean over tokens (vldist before issue 23), 1/12.6 of the official weight here
    Row("full-token", "4RRR + GSR, L_G per token", "vsrn", ["model.caption_loss_reduction=token"]),
]
RECALLS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"]
METRICS = {**{k: ("test", "full", k) for k in [*RECALLS, "rsum"]}, "best_epoch": ("best_epoch",)}

# The paper's Table 4: ablations on the MS-COCO 1K test set (ResNet-101 bottom-up region features,
# D = 2048), caption retrieval (i2t) R@1/5/10, then image retrieval (t2i) R@1/5/10; its rsum is the
# sum of the six.
_TABLE_4 = {
    "mean-pool": ("64.3", "90.5", "95.1", "49.2", "83.4", "91.5"),
    "gsr": ("72.3", "94.4", "98.0", "59.6", "88.6", "94.5"),
    "gsr-star": ("74.6", "94.6", "98.2", "61.2", "89.0", "94.8"),
    "full": ("76.2", "94.8", "98.2", "62.8", "89.7", "95.1"),
}
PAPER = {
    key: {**dict(zip(RECALLS, recalls, strict=True)), "rsum": paper_sum(recalls)} for key, recalls in _TABLE_4.items()
}

R1 = [Col("i2t_r1", "i2t R@1"), Col("t2i_r1", "t2i R@1"), Col("rsum", "rsum")]
R5_R10 = [Col("i2t_r5", "i2t R@5"), Col("i2t_r10", "i2t R@10"), Col("t2i_r5", "t2i R@5"), Col("t2i_r10", "t2i R@10")]
RSUM = Col("rsum", "rsum")


def tables(data: dict) -> str:
    """R@1 and rsum with each seed's rsum, the rsum comparison of neighbouring rows, then R@5 and R@10."""
    return blocks(
        ablation_table(data, ROWS, R1, per_seed=RSUM, paper=PAPER, paper_cols=paper_columns(R1)),
        spread_line(data, ROWS, RSUM, neighbours(ROWS, data)),
        ablation_table(data, ROWS, R5_R10, paper=PAPER, paper_cols=paper_columns(R5_R10)),
    )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="train.max_steps (default: the job's 600), for a smoke run")
    parser.add_argument("--shards", help="data.shards (default: the job's shards/synth, built on first use)")


def train(args: argparse.Namespace, root: Path, record: Recorder) -> list[str]:
    common = [
        "eval.baseline=false",
        "metrics.enabled=false",
        *([f"train.max_steps={args.steps}"] if args.steps is not None else []),
        *([f"data.shards={args.shards}"] if args.shards is not None else []),
    ]
    for row in ROWS:
        if row.key not in args.rows:
            continue
        for seed in args.seeds:
            run = train_once(row.job, root / row.key / f"seed{seed}", [*row.overrides, f"seed={seed}", *common])
            record(row, seed, run, pick(run.metrics, METRICS))
    return common


def main() -> None:
    bench_main(
        __doc__,
        "vsrn",
        "vsrn_ablation.py",
        ROWS,
        [Col("i2t_r1", "i2t R@1"), Col("t2i_r1", "t2i R@1"), RSUM],
        train,
        tables,
        options,
    )


if __name__ == "__main__":
    main()
