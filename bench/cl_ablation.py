"""Contrastive Learning's ablations in miniature (the paper's Tables 4 and 1), on the embedded scenes.

    python bench/cl_ablation.py [--root runs/cl_ablation] [--seeds 0 1 2] [--rows cl-p full]
                                [--results docs/results/cl_ablation.json]
    python bench/cl_ablation.py --from docs/results/cl_ablation.json    # the tables, no training

Per seed, one MLE captioner (jobs/captioner.yaml) and, from it, one CL run per row
(jobs/cl_caption.yaml with model.captioner_run=<that captioner>), each its own process:

    mle     the MLE base model (the captioner itself; always trained)
    cl-p    CL(P): positive term only      model.terms=positive
    cl-n    CL(N): negative term only      model.terms=negative
    full    CL                             model.terms=full

The paper (COCO val, CIDEr): full 1.142 > CL(P) 1.059 > base 1.042 > CL(N) 0.603 (Table 4), and
self-retrieval recall higher after CL than after MLE (Table 1). A run whose metrics.json exists is
kept, so an interrupted bench resumes and a second invocation with the same seeds regenerates
the results without training. Writes each run's numbers to --results (committed as
docs/results/cl_ablation.json) and prints two markdown tables, caption metrics and self-retrieval
(mean ± sample std over seeds, each seed's value, the paper's numbers; see
bench/ablation_runs.py), also written with the numbers to <root>/ablation.json. Self-retrieval
recall at K >= the pool (eval.self_retrieval_pool, 500 in the demo) is 100 by construction, so
only K below the pool is kept and shown.
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
    paper_columns,
    pick,
    spread_line,
    train_once,
)

MLE = Row("mle", "MLE", "captioner", [])
ROWS = [
    Row("cl-p", "CL(P)", "cl_caption", ["model.terms=positive"]),
    Row("cl-n", "CL(N)", "cl_caption", ["model.terms=negative"]),
    Row("full", "CL", "cl_caption", ["model.terms=full"]),
]
ALL_ROWS = [MLE, *ROWS]
SR_KS = [1, 5, 50, 500]  # vldist.metrics.self_retrieval's, the paper's
METRICS = {
    **{k: ("test", "captions", k) for k in ("cider_d", "bleu4", "meteor", "rouge_l")},
    **{f"sr_r{k}": ("test", "self_retrieval", f"r{k}") for k in SR_KS},
    "sr_pool": ("test", "self_retrieval", "n_images"),
}

# The paper's Table 4: AdaptiveAttention learned by MLE (base), + CL(P), + CL(N), + CL(full), MS-COCO
# (the text: validation), CIDEr / BLEU-4 / METEOR / ROUGE_L.
_TABLE_4 = {
    "mle": ("1.042", "0.327", "0.260", "0.540"),
    "cl-p": ("1.059", "0.334", "0.262", "0.545"),
    "cl-n": ("0.603", "0.212", "0.246", "0.479"),
    "full": ("1.142", "0.353", "0.271", "0.559"),
}
# The paper's Table 1: self-retrieval top-K recall (%) on the MS-COCO test set, 5,000 images in the
# pool, AdaptiveAttention (MLE) and AdaptiveAttention + CL; CL(P) and CL(N) are not in it.
_TABLE_1 = {"mle": ("0.10", "0.96", "11.76", "78.46"), "full": ("0.32", "1.18", "11.84", "80.96")}
PAPER = {
    key: {
        **dict(zip(["cider_d", "bleu4", "meteor", "rouge_l"], _TABLE_4[key], strict=True)),
        **dict(zip([f"sr_r{k}" for k in SR_KS], _TABLE_1.get(key, ()), strict=False)),
    }
    for key in _TABLE_4
}
PAPER_POOL = 5000

CAPTION_COLUMNS = [
    Col("cider_d", "CIDEr-D", 3),
    Col("bleu4", "BLEU-4", 3),
    Col("meteor", "METEOR", 3),
    Col("rouge_l", "ROUGE-L", 3),
]
CIDER, SR_R1 = CAPTION_COLUMNS[0], Col("sr_r1", "R@1")


def below_pool(metrics: dict) -> dict:
    """The run's numbers without the self-retrieval recalls at K >= the pool (100 by construction)."""
    pool = metrics.get("sr_pool")
    return {
        name: value
        for name, value in metrics.items()
        if not (name.startswith("sr_r") and pool is not None and int(name[4:]) >= pool)
    }


def sr_columns(data: dict) -> list[Col]:
    """R@K for each K below the smallest pool of the results' runs (and held by them)."""
    runs = [run["metrics"] for row in data["rows"].values() for run in row["runs"].values()]
    pools = [m["sr_pool"] for m in runs if "sr_pool" in m]
    if not pools:
        return []
    return [Col(f"sr_r{k}", f"R@{k}") for k in SR_KS if k < min(pools) and any(f"sr_r{k}" in m for m in runs)]


def tables(data: dict) -> str:
    """Caption metrics (CIDEr-D per seed; Table 4 beside them), then self-retrieval (R@1 per seed;
    Table 1 beside it), each with the comparisons the paper's claims rest on."""
    sr = sr_columns(data)
    pools = sorted(
        {
            m["metrics"]["sr_pool"]
            for row in data["rows"].values()
            for m in row["runs"].values()
            if "sr_pool" in m["metrics"]
        }
    )
    pool = " / ".join(f"{p:,}" for p in pools)
    return blocks(
        ablation_table(
            data,
            ALL_ROWS,
            CAPTION_COLUMNS,
            per_seed=CIDER,
            paper=PAPER,
            paper_cols=paper_columns(CAPTION_COLUMNS),
            first="model",
        ),
        spread_line(data, ALL_ROWS, CIDER, [("mle", "cl-p"), ("mle", "cl-n"), ("mle", "full"), ("cl-p", "full")]),
        ablation_table(
            data,
            ALL_ROWS,
            sr,
            per_seed=SR_R1 if sr else None,
            paper=PAPER,
            paper_cols=paper_columns(sr, f"paper (pool {PAPER_POOL:,}) "),
            first=f"self-retrieval (pool {pool})",
        )
        if sr
        else "",
        spread_line(data, ALL_ROWS, Col("sr_r1", "self-retrieval R@1"), [("mle", "full"), ("cl-p", "full")])
        if sr
        else "",
    )


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mle-steps", type=int, help="train.max_steps of the captioner (default: its job's)")
    parser.add_argument("--cl-steps", type=int, help="train.max_steps of CL (default: its job's)")
    parser.add_argument("--shards", help="data.shards (default: the jobs' shards/synth, built on first use)")


def train(args: argparse.Namespace, root: Path, record: Recorder) -> list[str]:
    common = ["eval.baseline=false", "metrics.enabled=false", *([f"data.shards={args.shards}"] if args.shards else [])]
    mle_steps = [f"train.max_steps={args.mle_steps}"] if args.mle_steps else []
    cl_steps = [f"train.max_steps={args.cl_steps}"] if args.cl_steps else []
    for seed in args.seeds:
        mle_dir = root / MLE.key / f"seed{seed}"
        run = train_once(MLE.job, mle_dir, [f"seed={seed}", *common, *mle_steps])
        record(MLE, seed, run, below_pool(pick(run.metrics, METRICS)), mle_steps)
        for row in ROWS:
            if row.key not in args.rows:
                continue
            argv = [*row.overrides, f"seed={seed}", f"model.captioner_run={mle_dir}", *common, *cl_steps]
            # with model.captioner_run, cl_caption is its CL stage alone, written to <output.dir>/cl
            run = train_once(row.job, root / row.key / f"seed{seed}", argv, "cl/metrics.json")
            record(
                row,
                seed,
                run,
                below_pool(pick(run.metrics, METRICS)),
                [*row.overrides, "model.captioner_run=<root>/mle/seed<k>", *cl_steps],
            )
    return common


def main() -> None:
    bench_main(
        __doc__,
        "cl",
        "cl_ablation.py",
        ALL_ROWS,
        [CIDER, Col("sr_r1", "self-retrieval R@1")],
        train,
        tables,
        options,
        row_keys=[row.key for row in ROWS],
    )


if __name__ == "__main__":
    main()
