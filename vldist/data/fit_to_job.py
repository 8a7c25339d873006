"""What a job leaves out of the shard set it trains on, said once as training starts (on rank 0):
the regions past data.max_regions, the caption words past data.max_caption_len (when they cut more
than 1% of the captions), and the samples of shards cut short that `python -m vldist.shards index
--partial` left out. Each is read from what the set's manifest and indexes record; a set that
records none of it (written before they did, or by another tool) is not guessed at: no warning.

    if engine.is_main:
        warn_what_the_job_leaves_out(config, recipe, shards.main)
"""

from __future__ import annotations

import logging

from vldist.errors import ShardsUnfitError
from vldist.store.location import redact

log = logging.getLogger("vldist.data")

_START_END = 2  # <start> and <end>: data.max_caption_len counts them (Vocab.encode)
# captions cut below this share go unsaid: a few long ones in a large set are the usual cut (COCO's
# longest run past 40 words), not a job that does not fit its set
CUT_CAPTIONS_SAID = 0.01


def keeps_first_regions(recipe) -> bool:
    """Whether the recipe keeps the first data.max_regions regions of an image and drops the rest
    (its `keeps_max_regions`: VSRN and the captioners pad to it; the two-branch networks pool every
    region)."""
    return bool(getattr(recipe, "keeps_max_regions", False))


def train_splits(config, recipe) -> list[str]:
    """The splits of the job's own set (data.shards) that the recipe trains on."""
    from vldist.data.streams import stream_sources

    sources = stream_sources(recipe.train_streams(config)).values()
    return list(dict.fromkeys(s.split for s in sources if s.shards in (None, config.data.shards)))


def what_the_job_leaves_out(config, recipe, shards) -> list[str]:
    """One line for each thing of the set `shards` (a ShardSet) that this job does not train on."""
    where, manifest, data = redact(shards.directory), shards.manifest, config.data
    lines = []
    held = (manifest.get("features") or {}).get("max_regions")
    if isinstance(held, int) and held > data.max_regions and keeps_first_regions(recipe):
        lines.append(
            f"the shard set {where} holds up to {held} regions per image and data.max_regions={data.max_regions} "
            f"keeps the first {data.max_regions} (set data.max_regions={held} to use them all)"
        )
    for split in train_splits(config, recipe):
        entry = manifest.get("splits", {}).get(split, {})
        line = _long_captions(where, split, entry.get("caption_words"), data.max_caption_len)
        if line:
            lines.append(line)
        line = _partial_shards(where, split, shards, entry)
        if line:
            lines.append(line)
    return lines


def warn_what_the_job_leaves_out(config, recipe, shards) -> None:
    """what_the_job_leaves_out as warnings: call it once, on rank 0."""
    for line in what_the_job_leaves_out(config, recipe, shards):
        log.warning("%s", line)


def _long_captions(where: str, split: str, words: dict | None, max_len: int) -> str | None:
    if not words:  # a set written before manifests counted caption words: unknown
        return None
    counts = {int(n): int(c) for n, c in words.items()}
    room, total = max_len - _START_END, sum(counts.values())
    cut = sum(c for n, c in counts.items() if n > room)
    if cut <= CUT_CAPTIONS_SAID * total:
        return None
    longest = max(counts)
    return (
        f"{cut} of the {total} {split} captions of the shard set {where} ({100 * cut / total:.1f}%) have more than "
        f"the {room} words data.max_caption_len={max_len} keeps (<start> and <end> count too), and lose the words "
        f"past them (the longest has {longest}: set data.max_caption_len={longest + _START_END} to keep every one "
        "whole)"
    )


def _partial_shards(where: str, split: str, shards, entry: dict) -> str | None:
    try:
        indexes = shards.sample_indexes(split)
    except ShardsUnfitError:
        return None  # an index that does not fit: the training streams refuse it, by name
    partial = [i for i in indexes or () if i.cut is not None]
    if not partial:
        return None
    listed = {s["file"]: s.get("samples") for s in entry.get("shards", [])}
    counts = [listed.get(i.shard) for i in partial]
    many = len(partial) > 1
    names = ", ".join(i.shard for i in partial[:3]) + (f" and {len(partial) - 3} more" if len(partial) > 3 else "")
    if all(isinstance(n, int) for n in counts):
        missed = sum(max(n - len(i), 0) for n, i in zip(counts, partial, strict=True))
        them = "those shards" if many else "it"
        what = f"{missed} of the manifest's {sum(counts)} samples of {them} are left out of training"
    else:
        what = "the samples after the cut are left out of training"
    return (
        f"{len(partial)} {split} shard{'s' if many else ''} of {where} {'are' if many else 'is'} cut short or "
        f"damaged and indexed with --partial ({names}): {what}. "
        f"`python -m vldist.shards verify {where}` lists where each breaks"
    )
