"""L2C's ablations in miniature (the paper's Tables 1 and 3), on the embedded image pairs.

    python bench/l2c_ablation.py [--root runs/l2c_ablation] [--seeds 0 1 2] [--epochs N] [--rows full no-gcn]

Each row is one run per seed of jobs/l2c.yaml with the overrides below, each its own process,
model selection by validation ROUGE-L (the paper's), scored on the test pairs:

    cnn-lstm         Table 1's CNN+LSTM: both images' pooled trunk features into an LSTM
    full             L2C, pairs + single-image captions (the paper's L2C [CUB+B2W])
    pairs-only       L2C on pairs alone (L2C [B2W])
    no-pooling       - semantic pooling: masked average pooling, one node (pairs alone, as Table 3)
    no-tv            - TV loss (pairs alone)
    no-gcn           - GCN (pairs alone)

The paper (Birds-to-Words validation, BLEU-4 / ROUGE-L / CIDEr-D): full 31.9 / 45.7 / 15.2;
- semantic pooling 24.5 / 43.2 / 7.2; - TV 29.3 / 44.8 / 13.6; - GCN 30.2 / 43.5 / 10.7 (Table 3,
B2W alone); CNN+LSTM 25.1 / 43.4 / 10.2 and CUB+B2W 32.3 / 46.2 / 16.4 (Table 1). A run whose
metrics.json exists is kept, so an interrupted bench resumes. Prints a markdown table (mean ±
sample std over seeds) and writes it with the raw numbers to <root>/ablation.json.
"""

from __future__ import annotations

from ablation_runs import ablation_parser, markdown_table, mean_std, report, train_once

ALONE = ["model.single_images=false"]
ROWS = [
    ("cnn-lstm", "CNN+LSTM", ["model.architecture=cnn_lstm"]),
    ("full", "L2C (pairs + single images)", []),
    ("pairs-only", "L2C (pairs alone)", ALONE),
    ("no-pooling", "- semantic pooling", [*ALONE, "model.pooling=average"]),
    ("no-tv", "- TV loss", [*ALONE, "model.tv_weight=0"]),
    ("no-gcn", "- GCN", [*ALONE, "model.gcn_layers=0"]),
]
COLUMNS = [("bleu4", "BLEU-4"), ("rouge_l", "ROUGE-L"), ("cider_d", "CIDEr-D"), ("meteor", "METEOR")]


def table(results: dict[str, list[dict]]) -> str:
    """Metrics x 100, as the paper prints them."""
    head = ["model", *(name for _, name in COLUMNS), "ROUGE-L per seed"]
    rows = []
    for label, runs in results.items():
        cells = [mean_std([100 * r["captions"][key] for r in runs]) for key, _ in COLUMNS]
        per_seed = " / ".join(f"{100 * r['captions']['rouge_l']:.1f}" for r in runs)
        rows.append([label, *cells, per_seed])
    return markdown_table(head, rows)


def main() -> None:
    parser = ablation_parser(__doc__, "l2c_ablation", [key for key, _, _ in ROWS])
    parser.add_argument("--epochs", type=int, help="train.epochs (default: the job's)")
    parser.add_argument("--shards", help="data.shards (default: the job's shards/synth_pairs, built on first use)")
    args = parser.parse_args()
    root = args.root.resolve()
    common = ["metrics.enabled=false", "eval.baseline=false", "model.baseline_stage=false", "model.visualize=0",
              *([f"train.epochs={args.epochs}"] if args.epochs else []),
              *([f"data.shards={args.shards}"] if args.shards else [])]

    results: dict[str, list[dict]] = {}
    raw: dict = {"seeds": args.seeds, "runs": {}}
    for seed in args.seeds:
        for key, label, overrides in ROWS:
            if key not in args.rows:
                continue
            metrics, seconds = train_once("l2c", root / key / f"seed{seed}", [*overrides, f"seed={seed}", *common])
            results.setdefault(label, []).append(metrics["test"])
            raw["runs"][f"{key}/seed{seed}"] = {"test": metrics["test"], "seconds": seconds, "overrides": overrides}
            print(f"{label}, seed {seed}: ROUGE-L {100 * metrics['test']['captions']['rouge_l']:.1f}", flush=True)

    report(root, table(results), raw)


if __name__ == "__main__":
    main()
