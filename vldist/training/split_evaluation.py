"""Evaluating a whole split: every sample once, in one process, with the skipped ones accounted for.

The retrieval protocol ranks every image against every caption, so a sample skipped as unreadable
changes what is measured: the result says how many were skipped, and a split that loses every
sample is an error that gives the first reasons.
"""

from __future__ import annotations

import math
from contextlib import closing
from pathlib import Path

from vldist.data.pictures import save_pictures
from vldist.data.pipeline import EvalStream, StreamSpec, make_loader
from vldist.data.shard_stream import listed_counts
from vldist.errors import EmptySplitError
from vldist.recipes.contract import check_evaluation


def eval_loader(config, recipe, shards, split: str, shielded_signals=(), persistent: bool = False):
    """The split's loader; `persistent`: its workers stay between evaluations (pipeline.Loader)."""
    urls = shards.urls(split)
    spec = StreamSpec(
        urls=urls,
        keep=recipe.sample_keys,
        optional=recipe.optional_keys,
        sample_fn=recipe.eval_sample,
        collate_fn=recipe.collate_eval,
        batch_size=config.data.eval_batch_size,
        seed=config.seed,
        access=shards.access,
        listed=listed_counts(shards.manifest, split, urls),
    )
    return make_loader(EvalStream(spec), min(config.data.workers, len(spec.urls)), shielded_signals, persistent)


def eval_batch_count(config, shards, split: str) -> int | None:
    samples = shards.num_samples(split)
    return math.ceil(samples / config.data.eval_batch_size) if samples else None


class SkipTally:
    """Strips the skip reports off evaluation batches and adds them up."""

    def __init__(self, where: str):
        self.where, self.count, self.reasons, self.batches_seen = where, 0, [], 0

    def batches(self, loader):
        # closing: the loader's workers end here, not in a finalizer, where a Ctrl-C is lost
        with closing(iter(loader)) as loaded:
            for batch in loaded:
                self.count += batch.pop("skipped", 0)
                self.reasons += batch.pop("skip_reasons", [])[: max(0, 3 - len(self.reasons))]
                batch.pop("skipped_by_shard", None)
                if batch.pop("only_skips", False):
                    continue
                self.batches_seen += 1
                yield batch
        if not self.batches_seen:
            first = "\n  ".join(self.reasons) or "(no sample was read: are the shards empty?)"
            raise EmptySplitError(
                f"{self.where} yielded no samples: {self.count} were skipped as unreadable. The first reasons:\n  "
                f"{first}\nRun `python -m vldist.shards verify <shard dir>` to list every problem."
            )


def evaluate_split(
    recipe, model, loader, device, where: str, validation: bool = False, images_dir: Path | None = None
) -> dict:
    """recipe.evaluate over the loader's batches, plus `skipped_samples` in the result, checked
    against the recipe contract (recipes/contract.py). Pictures a recipe returns under `images`
    (name -> PIL image) are written as PNG into `images_dir` and replaced by their paths (none kept
    without a directory)."""
    tally = SkipTally(where)
    # closing: should evaluate raise, the loader's workers end now, not at interpreter exit (where
    # multiprocessing's SIGTERM would not end them: they ignore the stop signals)
    with closing(tally.batches(loader)) as batches:
        result = recipe.evaluate(model, batches, device, validation=validation)
    check_evaluation(recipe, result, selecting=validation)
    result["skipped_samples"] = tally.count
    pictures = result.pop("images", None)
    if pictures and images_dir is not None:
        result["images"] = save_pictures(pictures, images_dir)
    return result
