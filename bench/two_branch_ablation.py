"""The two-branch networks' ablations in miniature (the paper's Tables 1-4), on the embedded scenes.

    python bench/two_branch_ablation.py [--root runs/two_branch_ablation] [--seeds 0 1 2] [--epochs 8]
                                        [--rows linear-single constraints]
                                        [--results docs/results/two_branch_ablation.json]
    python bench/two_branch_ablation.py --from docs/results/two_branch_ablation.json   # the tables, no training
    python bench/two_branch_ablation.py --phrase-shards shards/synth-hard   # Table 1's rows on the hard set

Each row is one run per seed of jobs/two_branch_embed.yaml or jobs/two_branch_sim.yaml with the
overrides below, on one task, no validation (the last model is tested), each its own process:

retrieval (Tables 2-4: i2t / t2i R@1, rsum, sentence-to-sentence R@1)
    linear-single       linear, single-dir       one FC per branch then L2 (no batch norm, the paper's
                                                 §4.2), sentence anchors only (lambda1 0, lambda2 1)
    linear-bi           linear, bi-dir           + image anchors
    nonlinear-single    nonlinear, single-dir    two layers per branch
    nonlinear-bi        nonlinear, bi-dir
    sampling            + neighbourhood sampling two sentences of each image in every batch
    sampling-equal      (control) the same with half the images a step and an epoch: nonlinear-bi's
                        steps and sentences (not in the paper)
    sampling-control    (control) nonlinear-bi with twice the images a step and an epoch, one
                        sentence each: sampling's steps and sentences, no two of one image in a
                        batch (not in the paper)
    constraints         + constraints            the neighbourhood term, lambda 0.2
    mean-words          constraints with a learned mean of word vectors for tf-idf (not in the paper)
    similarity          similarity network
phrase localisation (Table 1: R@1, R@5, R@10)
    embed-single        embedding, single positive      the phrase box's own region
    embed-augmented     embedding, augmented positives  a random proposal of IoU >= 0.7 at each visit
    embed-augmented-batch   the same, every region of the batch's other images a negative too
                        (not in the paper; one change from embed-augmented)
    sim-single          similarity, single positive
    sim-augmented       similarity, augmented positives

--phrase-shards DIR trains the phrase rows only (Table 1), on DIR (the harder phrase variant:
`python -m vldist.shards synth --phrases hard --out shards/synth-hard`), into runs of their own
(default --root runs/two_branch_phrases_hard) and a results file of their own (default --results
docs/results/two_branch_phrases_hard.json), so the standard set's rows and results stay as they
are; `--from` that file prints its phrase table.

A run whose metrics.json exists is kept, so an interrupted bench resumes and a second invocation
with the same seeds regenerates the results without training. Writes each run's numbers to
--results (committed as docs/results/two_branch_ablation.json) and prints markdown tables (mean ±
sample std over seeds, each seed's value, the paper's numbers; see bench/ablation_runs.py), also
written with the numbers to <root>/ablation.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ablation_runs import (
    REPO,
    Col,
    Recorder,
    Row,
    ablation_table,
    bench_main,
    blocks,
    paper_columns,
    paper_sum,
    pick,
    spread_line,
    train_once,
)

RETRIEVAL = ["model.tasks=[retrieval]"]
# single-directional: sentence anchors only, lambda1 = 0, lambda2 = 1 (the paper's §5.2)
SINGLE = ["model.lambda_image=0", "model.lambda_text=1", "model.sentences_per_image=1", "model.lambda_text_neighbors=0"]
# the paper's linear branch (§4.2): the first FC of each branch, then L2 normalisation, no batch norm
LINEAR = ["model.nonlinear=false", "model.batchnorm=none"]
BI = ["model.sentences_per_image=1", "model.lambda_text_neighbors=0"]
RETRIEVAL_ROWS = [
    Row("linear-single", "linear, single-dir", "two_branch_embed", [*RETRIEVAL, *LINEAR, *SINGLE]),
    Row("linear-bi", "linear, bi-dir", "two_branch_embed", [*RETRIEVAL, *LINEAR, *BI]),
    Row("nonlinear-single", "nonlinear, single-dir", "two_branch_embed", [*RETRIEVAL, *SINGLE]),
    Row("nonlinear-bi", "nonlinear, bi-dir", "two_branch_embed", [*RETRIEVAL, *BI]),
    Row(
        "sampling",
        "+ neighbourhood sampling",
        "two_branch_embed",
        [*RETRIEVAL, "model.sentences_per_image=2", "model.lambda_text_neighbors=0"],
    ),
    # not in the paper: the control for sampling's doubled sentences per step. Two sentences from
    # half as many images a step and half as many images an epoch: the steps, and the sentences
    # of each step and of the run, are nonlinear-bi's
    Row(
        "sampling-equal",
        "+ sampling, equal sentences",
        "two_branch_embed",
        [
            *RETRIEVAL,
            "model.sentences_per_image=2",
            "model.lambda_text_neighbors=0",
            "data.batch_size=125",
            "train.samples_per_epoch=2500",
        ],
    ),
    # not in the paper: the control for sampling's doubled sentences that keeps them all. One
    # sentence each of twice the images a step (500), twice the images an epoch: sampling's steps
    # and its sentences a step and a run, without two sentences of one image in a batch (and with
    # twice its images, so twice its image negatives)
    Row(
        "sampling-control",
        "bi-dir, sampling's sentences from twice the images",
        "two_branch_embed",
        [*RETRIEVAL, *BI, "data.batch_size=500", "train.samples_per_epoch=10000"],
    ),
    Row(
        "constraints",
        "+ constraints",
        "two_branch_embed",
        [*RETRIEVAL, "model.sentences_per_image=2", "model.lambda_text_neighbors=0.2"],
    ),
    # not in the paper: sentences as a learned mean of word vectors instead of tf-idf
    Row(
        "mean-words",
        "+ constraints, mean of word vectors",
        "two_branch_embed",
        [
            *RETRIEVAL,
            "model.sentences_per_image=2",
            "model.lambda_text_neighbors=0.2",
            "model.text_features=mean_words",
        ],
    ),
    Row("similarity", "similarity network", "two_branch_sim", [*RETRIEVAL]),
]
PHRASES = ["model.tasks=[phrases]"]
PHRASE_ROWS = [
    Row(
        "embed-single", "embedding, single positive", "two_branch_embed", [*PHRASES, "model.augmented_positives=false"]
    ),
    Row(
        "embed-augmented",
        "embedding, augmented positives",
        "two_branch_embed",
        [*PHRASES, "model.augmented_positives=true"],
    ),
    # not in the paper: every region of the batch's other images as negatives too, besides every
    # negative region of the phrase's own image (one change from embed-augmented)
    Row(
        "embed-augmented-batch",
        "embedding, augmented, other images' regions too",
        "two_branch_embed",
        [*PHRASES, "model.augmented_positives=true", "model.phrase_negatives_from=batch"],
    ),
    Row("sim-single", "similarity, single positive", "two_branch_sim", [*PHRASES, "model.augmented_positives=false"]),
    Row(
        "sim-augmented",
        "similarity, augmented positives",
        "two_branch_sim",
        [*PHRASES, "model.augmented_positives=true"],
    ),
]
ROWS = [*RETRIEVAL_ROWS, *PHRASE_ROWS]
METRICS = {
    "i2t_r1": ("test", "full", "i2t_r1"),
    "t2i_r1": ("test", "full", "t2i_r1"),
    "rsum": ("test", "full", "rsum"),
    "s2s_r1": ("test", "sentence_to_sentence", "r1"),  # the similarity network has none
    "phrase_r1": ("test", "phrases", "r1"),
    "phrase_r5": ("test", "phrases", "r5"),
    "phrase_r10": ("test", "phrases", "r10"),
}

# The paper's Table 2(b-c): bi-directional retrieval on Flickr30K, i2t R@1/5/10 then t2i R@1/5/10;
# rsum is the sum of the six. Rows 3-6 of 2(b) are the nonlinear ones.
_TABLE_2 = {
    "linear-single": ("33.5", "61.7", "73.6", "21.0", "47.4", "60.5"),
    "linear-bi": ("34.6", "64.3", "74.9", "24.2", "52.0", "64.2"),
    "nonlinear-single": ("37.5", "65.6", "76.9", "22.4", "50.9", "63.3"),
    "nonlinear-bi": ("39.0", "67.0", "77.6", "27.2", "57.0", "69.2"),
    "sampling": ("40.5", "68.8", "78.7", "28.9", "59.0", "71.3"),
    "constraints": ("40.7", "69.7", "79.2", "29.2", "59.6", "71.7"),
    "similarity": ("15.2", "39.7", "46.2", "11.0", "29.2", "41.6"),
}
# The paper's Table 4 (Flickr30K part): sentence-to-sentence R@1 of the (nonlinear, bi-directional)
# embedding network without neighbourhood sampling, with it, and with the constraints added.
_TABLE_4 = {"nonlinear-bi": "57.7", "sampling": "60.0", "constraints": "61.2"}
# The paper's Table 1(b-c): phrase localisation on Flickr30K Entities, R@1/5/10 (200 EdgeBox
# proposals). Nonlinear branches; the embedding rows are the bi-directional ones without
# neighbourhood sampling (the pair that differs only in the positives).
_TABLE_1 = {
    "embed-single": ("44.53", "67.46", "73.12"),
    "embed-augmented": ("49.09", "69.46", "74.80"),
    "sim-single": ("45.19", "67.14", "72.13"),
    "sim-augmented": ("51.05", "70.30", "75.04"),
}
PAPER = {
    **{
        key: {
            "i2t_r1": r[0],
            "t2i_r1": r[3],
            "rsum": paper_sum(r),
            **({"s2s_r1": _TABLE_4[key]} if key in _TABLE_4 else {}),
        }
        for key, r in _TABLE_2.items()
    },
    **{key: dict(zip(["phrase_r1", "phrase_r5", "phrase_r10"], r, strict=True)) for key, r in _TABLE_1.items()},
}

RETRIEVAL_COLUMNS = [Col("i2t_r1", "i2t R@1"), Col("t2i_r1", "t2i R@1"), Col("rsum", "rsum"), Col("s2s_r1", "s2s R@1")]
PHRASE_COLUMNS = [Col("phrase_r1", "R@1"), Col("phrase_r5", "R@5"), Col("phrase_r10", "R@10")]
RSUM, S2S, PHRASE_R1 = RETRIEVAL_COLUMNS[2], RETRIEVAL_COLUMNS[3], PHRASE_COLUMNS[0]


def tables(data: dict) -> str:
    """Retrieval (rsum per seed; Tables 2 and 4 beside it) and phrase localisation (R@1 per seed;
    Table 1), each with the comparisons the paper's claims rest on."""
    return blocks(
        ablation_table(
            data,
            RETRIEVAL_ROWS,
            RETRIEVAL_COLUMNS,
            per_seed=RSUM,
            paper=PAPER,
            paper_cols=paper_columns(RETRIEVAL_COLUMNS),
            first="retrieval",
        ),
        spread_line(
            data,
            ROWS,
            RSUM,
            [
                ("linear-single", "linear-bi"),
                ("nonlinear-single", "nonlinear-bi"),
                ("linear-single", "nonlinear-single"),
                ("linear-bi", "nonlinear-bi"),
                ("nonlinear-bi", "sampling"),
                ("nonlinear-bi", "sampling-equal"),
                ("sampling-equal", "sampling"),
                ("nonlinear-bi", "sampling-control"),
                ("sampling-control", "sampling"),
                ("sampling", "constraints"),
                ("constraints", "mean-words"),
                ("constraints", "similarity"),
            ],
        ),
        spread_line(
            data,
            ROWS,
            S2S,
            [
                ("nonlinear-bi", "sampling"),
                ("nonlinear-bi", "sampling-equal"),
                ("sampling-control", "sampling"),
                ("sampling", "constraints"),
            ],
        ),
        ablation_table(
            data,
            PHRASE_ROWS,
            PHRASE_COLUMNS,
            per_seed=PHRASE_R1,
            paper=PAPER,
            paper_cols=paper_columns(PHRASE_COLUMNS),
            first="phrase localisation",
        ),
        spread_line(
            data,
            ROWS,
            PHRASE_R1,
            [
                ("embed-single", "embed-augmented"),
                ("sim-single", "sim-augmented"),
                ("embed-augmented", "sim-augmented"),
                ("embed-augmented-batch", "embed-augmented"),
            ],
        ),
    )


HARD = "two_branch_phrases_hard"  # the runs' and results' name of the phrase rows on --phrase-shards


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=8, help="train.epochs of every run (default 8)")
    parser.add_argument("--shards", help="data.shards (default: the jobs' shards/synth, built on first use)")
    parser.add_argument(
        "--phrase-shards",
        metavar="DIR",
        help="train the phrase rows only, on DIR (e.g. shards/synth-hard, built by `python -m vldist.shards synth "
        f"--phrases hard --out shards/synth-hard`); then --root defaults to runs/{HARD} and --results to "
        f"docs/results/{HARD}.json",
    )
    # with --phrase-shards, the defaults of where runs and results go are the hard set's own
    given, _ = parser.parse_known_args()
    if given.phrase_shards is not None:
        parser.set_defaults(
            root=Path("runs") / HARD,
            results=REPO / "docs" / "results" / f"{HARD}.json",
            rows=[row.key for row in PHRASE_ROWS],
        )


def train(args: argparse.Namespace, root: Path, record: Recorder) -> list[str]:
    common = [
        "metrics.enabled=false",
        "eval.baseline=false",
        "train.validate_every=0",
        f"train.epochs={args.epochs}",
        *([f"data.shards={args.shards}"] if args.shards and not args.phrase_shards else []),
        *([f"data.shards={args.phrase_shards}"] if args.phrase_shards else []),
    ]
    if args.phrase_shards:
        retrieval = [key for key in args.rows if key not in {row.key for row in PHRASE_ROWS}]
        if retrieval:
            sys.exit(f"--phrase-shards trains the phrase rows only; leave out the retrieval rows {retrieval}")
    for rows in (RETRIEVAL_ROWS, PHRASE_ROWS):
        for row in rows:
            if row.key not in args.rows:
                continue
            for seed in args.seeds:
                run = train_once(row.job, root / row.key / f"seed{seed}", [*row.overrides, f"seed={seed}", *common])
                record(row, seed, run, pick(run.metrics, METRICS))
    return common


def main() -> None:
    bench_main(
        __doc__,
        "two_branch",
        "two_branch_ablation.py",
        ROWS,
        [*RETRIEVAL_COLUMNS, *(Col(c.metric, "phrase " + c.head) for c in PHRASE_COLUMNS)],
        train,
        tables,
        options,
    )


if __name__ == "__main__":
    main()
