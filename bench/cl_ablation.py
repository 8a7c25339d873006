"""Contrastive Learning's ablations in miniature (the paper's Tables 4 and 1), on the embedded scenes.

    python bench/cl_ablation.py [--root runs/cl_ablation] [--seeds 0 1 2] [--rows cl-p full]

Per seed, one MLE captioner (jobs/captioner.yaml) and, from it, one CL run per row
(jobs/cl_caption.yaml with model.captioner_run=<that captioner>), each its own process:

    mle     the MLE base model (the captioner itself)
    cl-p    CL(P): positive term only      model.terms=positive
    cl-n    CL(N): negative term only      model.terms=negative
    full    CL                             model.terms=full

The paper (COCO val, CIDEr): full 1.142 > CL(P) 1.059 > base 1.042 > CL(N) 0.603 (Table 4), and
self-retrieval recall higher after CL than after MLE (Table 1). A run whose metrics.json exists is
kept, so an interrupted bench resumes. Prints a markdown table (mean ± sample std over seeds) and
writes it with the raw numbers to <root>/ablation.json.
"""

from __future__ import annotations

from ablation_runs import ablation_parser, markdown_table, mean_std, report, train_once

ROWS = [("cl-p", "CL(P)", ["model.terms=positive"]), ("cl-n", "CL(N)", ["model.terms=negative"]),
        ("full", "CL", ["model.terms=full"])]
COLUMNS = [("captions", "cider_d", "CIDEr-D", 3), ("captions", "bleu4", "BLEU-4", 3),
           ("captions", "meteor", "METEOR", 3), ("captions", "rouge_l", "ROUGE-L", 3),
           ("self_retrieval", "r1", "SR R@1", 1), ("self_retrieval", "r5", "SR R@5", 1),
           ("self_retrieval", "r50", "SR R@50", 1)]


def table(results: dict[str, list[dict]]) -> str:
    head = ["model", *(name for *_, name, _ in COLUMNS), "CIDEr-D per seed"]
    rows = []
    for label, runs in results.items():
        cells = [mean_std([r[group][key] for r in runs], digits) for group, key, _, digits in COLUMNS]
        per_seed = " / ".join(f"{r['captions']['cider_d']:.3f}" for r in runs)
        rows.append([label, *cells, per_seed])
    return markdown_table(head, rows)


def main() -> None:
    parser = ablation_parser(__doc__, "cl_ablation", [key for key, _, _ in ROWS])
    parser.add_argument("--mle-steps", type=int, help="train.max_steps of the captioner (default: its job's)")
    parser.add_argument("--cl-steps", type=int, help="train.max_steps of CL (default: its job's)")
    parser.add_argument("--shards", help="data.shards (default: the jobs' shards/synth, built on first use)")
    args = parser.parse_args()
    root = args.root.resolve()
    common = ["metrics.enabled=false", *([f"data.shards={args.shards}"] if args.shards else [])]

    results: dict[str, list[dict]] = {"MLE": []}
    raw: dict = {"seeds": args.seeds, "runs": {}}
    for seed in args.seeds:
        mle_dir = root / "mle" / f"seed{seed}"
        steps = [f"train.max_steps={args.mle_steps}"] if args.mle_steps else []
        metrics, seconds = train_once("captioner", mle_dir, [f"seed={seed}", "eval.baseline=false", *common, *steps])
        results["MLE"].append(metrics["test"])
        raw["runs"][f"mle/seed{seed}"] = {"test": metrics["test"], "seconds": seconds}
        print(f"MLE, seed {seed}: CIDEr-D {metrics['test']['captions']['cider_d']:.3f}", flush=True)
        for key, label, overrides in ROWS:
            if key not in args.rows:
                continue
            steps = [f"train.max_steps={args.cl_steps}"] if args.cl_steps else []
            argv = [*overrides, f"seed={seed}", f"model.captioner_run={mle_dir}", "eval.baseline=false", *common, *steps]
            # with model.captioner_run, cl_caption is its CL stage alone, written to <output.dir>/cl
            metrics, seconds = train_once("cl_caption", root / key / f"seed{seed}", argv, "cl/metrics.json")
            results.setdefault(label, []).append(metrics["test"])
            raw["runs"][f"{key}/seed{seed}"] = {"test": metrics["test"], "seconds": seconds, "overrides": overrides}
            print(f"{label}, seed {seed}: CIDEr-D {metrics['test']['captions']['cider_d']:.3f}", flush=True)

    report(root, table(results), raw)


if __name__ == "__main__":
    main()
