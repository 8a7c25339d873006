"""The two-branch networks' ablations in miniature (the paper's Tables 1-4), on the embedded scenes.

    python bench/two_branch_ablation.py [--root runs/two_branch_ablation] [--seeds 0 1 2] [--epochs 8]

Each row is one run per seed of jobs/two_branch_embed.yaml or jobs/two_branch_sim.yaml with the
overrides below, on one task, no validation (the last model is tested), each its own process:

retrieval (Tables 2-4: i2t / t2i R@1, rsum, sentence-to-sentence R@1)
    linear, single-dir       one linear layer per branch, sentence anchors only
    linear, bi-dir           + image anchors
    nonlinear, single-dir    two layers per branch
    nonlinear, bi-dir
    + neighbourhood sampling two sentences of each image in every batch
    + constraints            the neighbourhood term, lambda 0.2
    similarity network
phrase localisation (Table 1: R@1, R@5, R@10)
    embedding, single positive      the phrase box's own region
    embedding, augmented positives  a random proposal of IoU >= 0.7 at each visit
    similarity, single positive
    similarity, augmented positives

A run whose metrics.json exists is kept, so an interrupted bench resumes. Prints markdown tables
(mean ± sample std over seeds) and writes them with the raw numbers to <root>/ablation.json.
"""

from __future__ import annotations

from ablation_runs import ablation_parser, markdown_table, mean_std, report, train_once

RETRIEVAL = ["model.tasks=[retrieval]"]
SINGLE = ["model.lambda_image=0", "model.sentences_per_image=1", "model.lambda_text_neighbors=0"]
BI = ["model.sentences_per_image=1", "model.lambda_text_neighbors=0"]
RETRIEVAL_ROWS = [
    ("linear-single", "linear, single-dir", "two_branch_embed", [*RETRIEVAL, "model.nonlinear=false", *SINGLE]),
    ("linear-bi", "linear, bi-dir", "two_branch_embed", [*RETRIEVAL, "model.nonlinear=false", *BI]),
    ("nonlinear-single", "nonlinear, single-dir", "two_branch_embed", [*RETRIEVAL, *SINGLE]),
    ("nonlinear-bi", "nonlinear, bi-dir", "two_branch_embed", [*RETRIEVAL, *BI]),
    ("sampling", "+ neighbourhood sampling", "two_branch_embed",
     [*RETRIEVAL, "model.sentences_per_image=2", "model.lambda_text_neighbors=0"]),
    ("constraints", "+ constraints", "two_branch_embed",
     [*RETRIEVAL, "model.sentences_per_image=2", "model.lambda_text_neighbors=0.2"]),
    ("similarity", "similarity network", "two_branch_sim", [*RETRIEVAL]),
]
PHRASES = ["model.tasks=[phrases]"]
PHRASE_ROWS = [
    ("embed-single", "embedding, single positive", "two_branch_embed", [*PHRASES, "model.augmented_positives=false"]),
    ("embed-augmented", "embedding, augmented positives", "two_branch_embed",
     [*PHRASES, "model.augmented_positives=true"]),
    ("sim-single", "similarity, single positive", "two_branch_sim", [*PHRASES, "model.augmented_positives=false"]),
    ("sim-augmented", "similarity, augmented positives", "two_branch_sim",
     [*PHRASES, "model.augmented_positives=true"]),
]
RETRIEVAL_COLUMNS = [("full", "i2t_r1", "i2t R@1"), ("full", "t2i_r1", "t2i R@1"), ("full", "rsum", "rsum"),
                     ("sentence_to_sentence", "r1", "s2s R@1")]
PHRASE_COLUMNS = [("phrases", "r1", "R@1"), ("phrases", "r5", "R@5"), ("phrases", "r10", "R@10")]


def table(results: dict[str, list[dict]], columns) -> str:
    head = ["model", *(name for *_, name in columns)]
    rows = []
    for label, runs in results.items():
        cells = [mean_std([r[group][key] for r in runs]) if all(group in r for r in runs) else "n/a"
                 for group, key, _ in columns]
        rows.append([label, *cells])
    return markdown_table(head, rows)


def main() -> None:
    parser = ablation_parser(__doc__, "two_branch_ablation")
    parser.add_argument("--epochs", type=int, default=8, help="train.epochs of every run (default 8)")
    parser.add_argument("--shards", help="data.shards (default: the jobs' shards/synth, built on first use)")
    args = parser.parse_args()
    root = args.root.resolve()
    common = ["metrics.enabled=false", "eval.baseline=false", "train.validate_every=0", f"train.epochs={args.epochs}",
              *([f"data.shards={args.shards}"] if args.shards else [])]

    raw: dict = {"seeds": args.seeds, "epochs": args.epochs, "runs": {}}
    tables = []
    for title, rows, columns in (("retrieval", RETRIEVAL_ROWS, RETRIEVAL_COLUMNS),
                                 ("phrase localisation", PHRASE_ROWS, PHRASE_COLUMNS)):
        results: dict[str, list[dict]] = {}
        for key, label, job, overrides in rows:
            for seed in args.seeds:
                metrics, seconds = train_once(job, root / key / f"seed{seed}", [*overrides, f"seed={seed}", *common])
                results.setdefault(label, []).append(metrics["test"])
                raw["runs"][f"{key}/seed{seed}"] = {"test": metrics["test"], "seconds": seconds, "job": job,
                                                    "overrides": overrides}
                print(f"{label}, seed {seed}: " + ", ".join(
                    f"{name} {metrics['test'][group][k]:.1f}" for group, k, name in columns
                    if group in metrics["test"]), flush=True)
        tables.append(f"{title}:\n\n" + table(results, columns))

    report(root, "\n\n".join(tables), raw, key="tables")


if __name__ == "__main__":
    main()
