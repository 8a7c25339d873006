"""VSRN's ablations (the paper's Tables 4 and 5) in miniature, on the embedded synthetic scenes.

    python bench/vsrn_ablation.py [--root runs/vsrn_ablation] [--seeds 0 1 2] [--rows gsr full]
                                  [--results docs/results/vsrn_ablation.json]
    python bench/vsrn_ablation.py --from docs/results/vsrn_ablation.json    # the tables, no training

Trains the demo job (jobs/vsrn.yaml, 600 steps) once per row and seed, each as its own
`python -m vldist.train vsrn ... output.dir=<root>/<row>/seed<k>` process:

    mean-pool      Mean-pool baseline       model.rrr_layers=0 model.global_reasoning=mean
    rrr            RRR (1 layer, mean-pool) model.rrr_layers=1 model.global_reasoning=mean
    gsr            GSR only (0 RRR layers)  model.rrr_layers=0
    1rrr-gsr       1RRR + GSR               model.rrr_layers=1
    gsr-star       4RRR + GSR*              model.caption_loss=false   (no generation loss L_G)
    full           4RRR + GSR               the demo's defaults (regions in their stored order)
    full-token     4RRR + GSR, L_G averaged over tokens instead of summed per caption (not in the paper)
    region-random  4RRR + GSR, regions shuffled  model.region_order=random   (Table 5's VSRN-Random)

Table 4's "RRR" row is, in the paper's words, the Mean-pool baseline with "one region relationship
reasoning (RRR) layer before the mean-pooling operation": the reasoned regions V* mean-pooled, no
GRU (model.global_reasoning=mean builds none). Table 5 orders the regions for the GRU by detector
confidence (VSRN-Confidence, the paper's default), by box size, largest first (VSRN-BboxSize), or at
random (VSRN-Random). The synthetic set stores its regions as the whole image, then the objects
largest first (vldist/shards/synthetic/synth.py, region_boxes), and has no detector confidences: the
stored order here is the paper's VSRN-BboxSize (model.region_order=size gives the same order up to
ties), so Table 5's table compares `full` with the BboxSize row's numbers and `region-random`
(a fresh shuffle per training visit, one fixed shuffle per image in evaluation) with VSRN-Random.

A run whose metrics.json exists is not run again, so an interrupted bench resumes where it
stopped, and a second invocation with the same seeds regenerates the results without training.
Then writes each run's test recalls, rsum, best epoch and seconds to --results (committed as
docs/results/vsrn_ablation.json) and prints the tables (mean ± sample std over seeds, each seed's
rsum, the paper's Tables 4 and 5 beside them; see bench/ablation_runs.py) with the row-against-row
rsum comparisons: neighbouring rows of Table 4's first five (as before issue 45), the added rows
each against a row one change away, and Table 5's two orders. Also written with the numbers to
<root>/ablation.json. A table or comparison whose rows the results lack is left out. Each run's
log is <root>/<row>/seed<k>/train.log. On a 2-core CPU a run takes about 4-6 minutes, so the 24
runs of the default take about two hours; `--steps 5` makes a quick smoke run (give it its own
--root and --results).
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

# Table 4's rows in the paper's order, weakest first (4RRR + GSR* before 4RRR + GSR, as its numbers)
ROWS = [
    Row("mean-pool", "Mean-pool", "vsrn", ["model.rrr_layers=0", "model.global_reasoning=mean"]),
    Row("rrr", "RRR", "vsrn", ["model.rrr_layers=1", "model.global_reasoning=mean"]),
    Row("gsr", "GSR", "vsrn", ["model.rrr_layers=0"]),
    Row("1rrr-gsr", "1RRR + GSR", "vsrn", ["model.rrr_layers=1"]),
    Row("gsr-star", "4RRR + GSR*", "vsrn", ["model.caption_loss=false"]),
    Row("full", "4RRR + GSR", "vsrn", []),
    # not in the paper: L_G as a mean over tokens (vldist before issue 23), 1/12.6 of the official weight here
    Row("full-token", "4RRR + GSR, L_G per token", "vsrn", ["model.caption_loss_reduction=token"]),
    # Table 5: the regions shuffled before the GRU (the other rows keep the stored order)
    Row("region-random", "4RRR + GSR, regions shuffled", "vsrn", ["model.region_order=random"]),
]
BY_KEY = {row.key: row for row in ROWS}
TABLE_4 = [row for row in ROWS if row.key != "region-random"]
# the rows compared neighbour against neighbour before issue 45 (the committed tables' comparisons)
CHAIN = [BY_KEY[k] for k in ("mean-pool", "gsr", "gsr-star", "full", "full-token")]
# the added rows, each against a row that differs from it in one setting
ONE_CHANGE = [
    ("mean-pool", "rrr"),  # an RRR layer before the mean pooling
    ("rrr", "1rrr-gsr"),  # after one RRR layer, the GRU instead of the mean pooling
    ("gsr", "1rrr-gsr"),  # an RRR layer before the GRU
    ("1rrr-gsr", "full"),  # 1 RRR layer -> 4
]
# Table 5: the stored order (the synthetic set's is by box size) against a shuffled one
TABLE_5 = [
    Row("region-random", "4RRR + GSR, regions shuffled", "vsrn", BY_KEY["region-random"].overrides),
    Row("full", "4RRR + GSR, stored order (by size)", "vsrn", []),
]
RECALLS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"]
METRICS = {**{k: ("test", "full", k) for k in [*RECALLS, "rsum"]}, "best_epoch": ("best_epoch",)}

# The paper's Table 4: ablations on the MS-COCO 1K test set (ResNet-101 bottom-up region features,
# D = 2048), caption retrieval (i2t) R@1/5/10, then image retrieval (t2i) R@1/5/10; its rsum is the
# sum of the six.
_TABLE_4 = {
    "mean-pool": ("64.3", "90.5", "95.1", "49.2", "83.4", "91.5"),
    "rrr": ("68.5", "93.2", "96.3", "56.8", "87.2", "94.2"),
    "gsr": ("72.3", "94.4", "98.0", "59.6", "88.6", "94.5"),
    "1rrr-gsr": ("75.3", "94.7", "98.1", "62.1", "89.2", "94.9"),
    "gsr-star": ("74.6", "94.6", "98.2", "61.2", "89.0", "94.8"),
    "full": ("76.2", "94.8", "98.2", "62.8", "89.7", "95.1"),
}
# Table 5 (the same test set): VSRN-Random, and VSRN-BboxSize for the stored order (see above)
_TABLE_5 = {
    "region-random": ("75.1", "94.5", "98.0", "62.3", "89.1", "94.6"),
    "full": ("75.8", "94.9", "98.4", "62.5", "89.5", "94.8"),
}


def _paper(table: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    return {
        key: {**dict(zip(RECALLS, recalls, strict=True)), "rsum": paper_sum(recalls)} for key, recalls in table.items()
    }


PAPER = _paper(_TABLE_4)
PAPER_5 = _paper(_TABLE_5)

R1 = [Col("i2t_r1", "i2t R@1"), Col("t2i_r1", "t2i R@1"), Col("rsum", "rsum")]
R5_R10 = [Col("i2t_r5", "i2t R@5"), Col("i2t_r10", "i2t R@10"), Col("t2i_r5", "t2i R@5"), Col("t2i_r10", "t2i R@10")]
RSUM = Col("rsum", "rsum")


def tables(data: dict) -> str:
    """Table 4's R@1 and rsum with each seed's rsum; the rsum comparisons of neighbouring rows (of
    CHAIN) and of the added rows (ONE_CHANGE); R@5 and R@10; then Table 5's, when the shuffled row
    is there."""
    parts = [
        ablation_table(data, TABLE_4, R1, per_seed=RSUM, paper=PAPER, paper_cols=paper_columns(R1)),
        spread_line(data, CHAIN, RSUM, neighbours(CHAIN, data)),
        titled("The added rows, each against the row one setting away:", spread_line(data, ROWS, RSUM, ONE_CHANGE)),
        ablation_table(data, TABLE_4, R5_R10, paper=PAPER, paper_cols=paper_columns(R5_R10)),
    ]
    if "region-random" in data["rows"]:
        parts += [
            "Region order (Table 5; the paper's numbers: VSRN-Random, and VSRN-BboxSize for the stored order):",
            ablation_table(data, TABLE_5, R1, per_seed=RSUM, paper=PAPER_5, paper_cols=paper_columns(R1)),
            spread_line(data, TABLE_5, RSUM, [("region-random", "full")]),
        ]
    return blocks(*parts)


def titled(title: str, text: str) -> str:
    """text under its title line; '' when there is no text."""
    return f"{title}\n{text}" if text else ""


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
