"""How often a training batch holds one image twice: the pairs that, masked by row alone, would
be each other's hardest negatives (issue 23; data/identity.py).

    python bench/duplicate_negatives.py [--job vsrn] [--ranks 1 2] [--json out.json] [KEY=VALUE ...]

Reads the job's training stream exactly as its run would (the trainer's own stream construction,
each rank's seed, shuffle buffer and loader workers) for the job's whole schedule, joins the ranks'
batches into global batches, and counts per global batch the pairs of samples with one identity
(a sample seen 3 times makes 3 pairs). Nothing trains. The demo job reads 600 batches of 128.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

from vldist.data.job_shards import build_missing, open_job_shards
from vldist.data.streams import TrainingStreams
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config


def rank_identities(config, rank: int, world_size: int) -> list[list[int]]:
    """Every training batch's identities on `rank`, in step order, over the job's schedule."""
    recipe_cls = get_recipe(config.recipe)
    build_missing(config, recipe_cls)
    shards = open_job_shards(config, recipe_cls)
    with tempfile.TemporaryDirectory() as cache:  # the vocabulary shapes no draw; cache it nowhere
        vocab = shards.main.vocab(Path(cache), config.data.vocab_min_count)
    recipe = recipe_cls(config, vocab, shards.main.feature_dim())
    # The trainer's own streams, without a model or an engine: the same seeds and counts.
    accumulation = config.train.grad_accumulation
    streams = TrainingStreams(config, recipe, shards, rank, world_size, accumulation)
    per_epoch = streams.micro_per_epoch // accumulation
    steps = config.train.max_steps or config.train.epochs * per_epoch
    batches: list[list[int]] = []
    for epoch in range(-(-steps // per_epoch)):
        batches += [batch["identity"].tolist() for batch in streams.batches(epoch)]
    return batches[:steps]


def count(job: str, world_size: int, overrides: list[str]) -> dict:
    config = load_config(job, overrides)
    per_rank = [rank_identities(config, rank, world_size) for rank in range(world_size)]
    pairs = []
    for step in zip(*per_rank, strict=True):
        seen = Counter(i for batch in step for i in batch)
        pairs.append(sum(n * (n - 1) // 2 for n in seen.values()))
    return {
        "job": job,
        "overrides": overrides,
        "ranks": world_size,
        "global_batch": config.data.batch_size,
        "batches": len(pairs),
        "batches_with_a_repeat": sum(p > 0 for p in pairs),
        "duplicate_pairs": sum(pairs),
        "pairs_per_batch": sum(pairs) / max(len(pairs), 1),
        "most_in_one_batch": max(pairs, default=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="vsrn")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("overrides", nargs="*", help="job keys, as on the train command line")
    args = parser.parse_args()
    results = [count(args.job, w, args.overrides) for w in args.ranks]
    print(
        f"{'ranks':>5} {'global batch':>12} {'batches':>8} {'with a repeat':>14} {'pairs':>6} {'per batch':>10} "
        f"{'most':>5}"
    )
    for r in results:
        print(
            f"{r['ranks']:>5} {r['global_batch']:>12} {r['batches']:>8} {r['batches_with_a_repeat']:>14} "
            f"{r['duplicate_pairs']:>6} {r['pairs_per_batch']:>10.2f} {r['most_in_one_batch']:>5}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
