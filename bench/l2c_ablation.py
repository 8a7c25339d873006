"""L2C's ablations in miniature (the paper's Tables 1 and 3), on the embedded image pairs.

    python bench/l2c_ablation.py [--root runs/l2c_ablation] [--seeds 0 1 2] [--epochs N] [--rows full no-gcn]
                                 [--results docs/results/l2c_ablation.json]
    python bench/l2c_ablation.py --from docs/results/l2c_ablation.json    # the table, no training

Each row is one run per seed of jobs/l2c.yaml with the overrides below, each its own process,
model selection by validation ROUGE-L (the paper's), scored on the test pairs:

    cnn-lstm         Table 1's CNN+LSTM: both images' pooled trunk features into an LSTM
    full             L2C, pairs + single-image captions (the paper's L2C [CUB+B2W])
    full-no-mask     the same without the mask head's loss (a control: CNN+LSTM has none; not in the paper)
    pairs-only       L2C on pairs alone (L2C [B2W])
    pairs-equal-steps  pairs alone for twice the epochs: the full row's optimizer steps (a control; not in the paper)
    no-pooling       - semantic pooling: masked average pooling, one node (pairs alone, as Table 3)
    no-tv            - TV loss (pairs alone)
    tv-sum           TV as Eq. 2's plain sum over the batch, λ = 1 (pairs alone; not in the paper)
    no-gcn           - GCN (pairs alone)
    normalized       pairs alone with nodes normalised by their pooling weight (not in the paper)
    normalized-no-gcn  the same without the GCN (not in the paper)

Why pairs-equal-steps: the full row takes one single-image step per pair step (the single stream
`steps_like` the pairs), so in the same epochs it takes twice the pairs-only row's optimizer steps,
and runs still improve at the bench's epochs. "Single-image captions help" compares full with
pairs-only and so also measures the doubled steps. The control trains pairs-only with the full
row's steps: twice the epochs (train.epochs = 2 x the bench's), the lr decay at the same step
(train.lr_decay_epochs = 2 x the job's) and validation at the same steps (train.validate_every=2,
so model selection sees as many checkpoints at the same steps). full against pairs-equal-steps
then differs only in what half of the steps train on, single images or more pairs: the same
optimizer steps, learning rates and model selection, so a lead of full there is the single images'
and not the steps'. (The other control, full with pairs-only's steps, would halve full's pair
steps too, so a loss there could be the missing pairs as well as no help from single images.)
pairs-only against pairs-equal-steps says what the doubled steps alone give.

The paper (Birds-to-Words validation, BLEU-4 / ROUGE-L / CIDEr-D): full 31.9 / 45.7 / 15.2;
- semantic pooling 24.5 / 43.2 / 7.2; - TV 29.3 / 44.8 / 13.6; - GCN 30.2 / 43.5 / 10.7 (Table 3,
B2W alone); CNN+LSTM 25.1 / 43.4 / 10.2 and CUB+B2W 32.3 / 46.2 / 16.4 (Table 1). A run whose
metrics.json exists is kept, so an interrupted bench resumes and a second invocation with the
same seeds regenerates the results without training. Writes each run's numbers to --results
(committed as docs/results/l2c_ablation.json) and prints a markdown table (metrics x 100, mean ±
sample std over seeds, each seed's ROUGE-L, the paper's numbers; see bench/ablation_runs.py), also
written with the numbers to <root>/ablation.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from ablation_runs import (
    REPO,
    Col,
    Recorder,
    Row,
    ablation_table,
    bench_main,
    blocks,
    paper_columns,
    pick,
    spread_line,
    train_once,
)

ALONE = ["model.single_images=false"]
ROWS = [
    Row("cnn-lstm", "CNN+LSTM", "l2c", ["model.architecture=cnn_lstm"]),
    Row("full", "L2C (pairs + single images)", "l2c", []),
    # not in the paper: the control for the mask loss, which only the L2C rows have (CNN+LSTM has no mask head)
    Row("full-no-mask", "L2C (pairs + single images), no mask loss", "l2c", ["model.mask_weight=0"]),
    Row("pairs-only", "L2C (pairs alone)", "l2c", ALONE),
    # not in the paper: pairs alone with the full row's optimizer steps (equal_steps(): the epochs
    # depend on --epochs), the control for "single images help" (the docstring says why)
    Row("pairs-equal-steps", "L2C (pairs alone), the full row's steps", "l2c", ALONE),
    Row("no-pooling", "− semantic pooling", "l2c", [*ALONE, "model.pooling=average"]),
    Row("no-tv", "− TV loss", "l2c", [*ALONE, "model.tv_weight=0"]),
    # not in the paper: Eq. 2 as its plain sum over the batch (λ = 1 then weighs it B·K·H·W = 73,728 times more)
    Row("tv-sum", "TV as a plain sum (pairs alone)", "l2c", [*ALONE, "model.tv_reduction=sum"]),
    Row("no-gcn", "− GCN", "l2c", [*ALONE, "model.gcn_layers=0"]),
    # not in the paper: nodes normalised by their pooling weight (model.normalize_pool), which puts
    # them on the scale the GCN's zero-initialised batch norm can leave the identity from (issue 23,
    # part 5: bench/reasoning_identity.py), with and without the GCN
    Row("normalized", "L2C (pairs alone), normalised nodes", "l2c", [*ALONE, "model.normalize_pool=true"]),
    Row(
        "normalized-no-gcn",
        "− GCN, normalised nodes",
        "l2c",
        [*ALONE, "model.normalize_pool=true", "model.gcn_layers=0"],
    ),
]
EQUAL_STEPS = "pairs-equal-steps"
METRICS = {k: ("test", "captions", k) for k in ("bleu4", "rouge_l", "cider_d", "meteor")}

# BLEU-4 / ROUGE-L / CIDEr-D (x 100) on the Birds-to-Words validation split: the paper's Table 3
# (ablations, trained on B2W alone) has only validation numbers, so Table 1's rows are its
# validation columns too (CNN+LSTM; L2C [B2W], which is Table 3's L2C; L2C [CUB+B2W]). The paper
# reports no METEOR.
PAPER = {
    key: dict(zip(["bleu4", "rouge_l", "cider_d"], values, strict=True))
    for key, values in {
        "cnn-lstm": ("25.1", "43.4", "10.2"),  # Table 1
        "full": ("32.3", "46.2", "16.4"),  # Table 1, L2C [CUB+B2W]
        "pairs-only": ("31.9", "45.7", "15.2"),  # Table 1, L2C [B2W] = Table 3, L2C
        "no-pooling": ("24.5", "43.2", "7.2"),  # Table 3
        "no-tv": ("29.3", "44.8", "13.6"),  # Table 3
        "no-gcn": ("30.2", "43.5", "10.7"),  # Table 3
    }.items()
}

COLUMNS = [
    Col("bleu4", "BLEU-4", scale=100),
    Col("rouge_l", "ROUGE-L", scale=100),
    Col("cider_d", "CIDEr-D", scale=100),
    Col("meteor", "METEOR", scale=100),
]
ROUGE = COLUMNS[1]


def tables(data: dict) -> str:
    """Metrics x 100, as the paper prints them; each seed's ROUGE-L (the paper's main metric)."""
    return blocks(
        ablation_table(
            data, ROWS, COLUMNS, per_seed=ROUGE, paper=PAPER, paper_cols=paper_columns(COLUMNS[:3]), first="model"
        ),
        spread_line(
            data,
            ROWS,
            ROUGE,
            [
                ("cnn-lstm", "full"),
                ("full-no-mask", "full"),
                ("cnn-lstm", "full-no-mask"),
                ("pairs-only", "full"),
                ("pairs-equal-steps", "full"),
                ("pairs-only", "pairs-equal-steps"),
                ("no-pooling", "pairs-only"),
                ("no-tv", "pairs-only"),
                ("tv-sum", "pairs-only"),
                ("no-gcn", "pairs-only"),
                ("normalized-no-gcn", "normalized"),
                ("pairs-only", "normalized"),
            ],
        ),
    )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="train.epochs (default: the job's)")
    parser.add_argument("--shards", help="data.shards (default: the job's shards/synth_pairs, built on first use)")


def equal_steps(epochs: int | None) -> list[str]:
    """The pairs-equal-steps row's own overrides: as many optimizer steps as the full row in
    `epochs` (None: the job's), its lr decay and validations at the same steps. The full row takes
    2 steps an epoch per pairs-only step (one pair and one single-image batch), its decay comes
    after lr_decay_epochs of its epochs and it validates after each epoch."""
    train = yaml.safe_load((REPO / "jobs" / "l2c.yaml").read_text())["train"]
    epochs = epochs or train["epochs"]
    return [
        f"train.epochs={2 * epochs}",
        f"train.lr_decay_epochs={2 * train['lr_decay_epochs']}",
        "train.validate_every=2",
    ]


def train(args: argparse.Namespace, root: Path, record: Recorder) -> list[str]:
    common = [
        "metrics.enabled=false",
        "eval.baseline=false",
        "model.baseline_stage=false",
        "model.visualize=0",
        *([f"train.epochs={args.epochs}"] if args.epochs else []),
        *([f"data.shards={args.shards}"] if args.shards else []),
    ]
    for seed in args.seeds:
        for row in ROWS:
            if row.key not in args.rows:
                continue
            overrides, rest = list(row.overrides), common
            if row.key == EQUAL_STEPS:  # its own epochs instead of the common ones
                overrides += equal_steps(args.epochs)
                rest = [c for c in common if not c.startswith("train.epochs=")]
            run = train_once(row.job, root / row.key / f"seed{seed}", [*overrides, f"seed={seed}", *rest])
            record(row, seed, run, pick(run.metrics, METRICS), overrides)
    return common


def main() -> None:
    bench_main(__doc__, "l2c", "l2c_ablation.py", ROWS, [ROUGE], train, tables, options)


if __name__ == "__main__":
    main()
