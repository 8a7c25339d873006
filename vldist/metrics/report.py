"""The short results table printed after training and evaluation."""

from __future__ import annotations

import math
import operator
from collections import Counter
from math import comb
from pathlib import Path

COLUMNS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")


def chance_recall(n_images: int, captions_per_image: int = 5, *, caption_counts=None) -> dict[str, float]:
    """Expected recall (percent) of a random ranking, in the keys of `retrieval_recall`.

    i2t: an image finds one of its c_i captions in the top K of all N captions, i.e.
    1 - C(N - c_i, K) / C(N, K), averaged over images. t2i: the true image is in the top K of
    n_images. `caption_counts` (one count per image, each >= 1) replaces the regular layout of
    `captions_per_image` captions per image; `captions_per_image` is then ignored.
    """
    counts = _caption_counts(n_images, captions_per_image, caption_counts)
    n_caps = sum(c * m for c, m in counts.items())
    out = {}
    for k in (1, 5, 10):
        top = min(k, n_caps)  # with K >= N every caption is in the top K
        # Exact integers, one comb per distinct count (fast for COCO's 25K captions), and one
        # rounding at the end: 1 - misses/total in floats would cancel to ~1e-15 noise at R@1.
        total = n_images * comb(n_caps, top)
        misses = sum(m * comb(n_caps - c, top) for c, m in counts.items())
        out[f"i2t_r{k}"] = 100 * (total - misses) / total
        out[f"t2i_r{k}"] = 100 * min(k, n_images) / n_images
    out["rsum"] = sum(out.values())
    return out


def _caption_counts(n_images, captions_per_image, caption_counts) -> Counter:
    """{captions of an image: number of images with that many}, validated."""
    if caption_counts is None:
        return Counter({captions_per_image: n_images})
    try:
        counts = [operator.index(c) for c in caption_counts]  # ints only: 2.5 captions is a bug
    except TypeError:
        raise ValueError(f"caption_counts must hold integer counts, got {caption_counts!r:.80}") from None
    if len(counts) != n_images:
        raise ValueError(f"caption_counts has {len(counts)} entries; expected one per image (n_images={n_images})")
    empty = [i for i, c in enumerate(counts) if c < 1]
    if empty:
        raise ValueError(
            f"image {empty[0]} has caption count {counts[empty[0]]}; every image needs "
            f">= 1 caption ({len(empty)} image(s) without)"
        )
    return Counter(counts)


def retrieval_table(rows: dict[str, dict[str, float]]) -> str:
    header = f"{'':<12}{'i2t R@1':>9}{'R@5':>7}{'R@10':>7}{'t2i R@1':>10}{'R@5':>7}{'R@10':>7}{'rsum':>9}"
    lines = [header]
    for name, m in rows.items():
        v = [m[c] for c in COLUMNS]
        lines.append(f"{name:<12}{v[0]:>9.1f}{v[1]:>7.1f}{v[2]:>7.1f}{v[3]:>10.1f}{v[4]:>7.1f}{v[5]:>7.1f}{v[6]:>9.1f}")
    return "\n".join(lines)


def retrieval_report(rows: dict[str, dict[str, float]], metrics: dict, split: str) -> str:
    """The table, the 1K five-fold table when there is one, and what the protocol left out."""
    lines = [retrieval_table(rows)]
    if "1k_5fold" in metrics:
        lines.append("1K five-fold:\n" + retrieval_table({list(rows)[-1]: metrics["1k_5fold"]}))
    if metrics.get("skipped_samples"):
        lines.append(
            f"{metrics['skipped_samples']} samples of the {split} split were unreadable and skipped "
            f"(see the warnings): the protocol ran on the {metrics['n_images']} images that remain"
        )
    return "\n".join(lines)


CAPTION_COLUMNS = {
    "bleu1": "BLEU-1",
    "bleu2": "BLEU-2",
    "bleu3": "BLEU-3",
    "bleu4": "BLEU-4",
    "meteor": "METEOR",
    "rouge_l": "ROUGE-L",
    "cider_d": "CIDEr-D",
}


def score_cell(value: float) -> str:
    return f"{value:>9.3f}" if math.isfinite(value) else f"{'n/a':>9}"  # METEOR timed out: NaN


def caption_report(rows: dict[str, dict], split: str) -> str:
    """Caption metrics (on pycocoevalcap's scale) and self-retrieval recall (percent) per model,
    then the last model's example captions beside their references."""
    last = list(rows.values())[-1]
    retrieval = "self_retrieval" in last  # captioners; L2C's pair descriptions have none
    # R@K from K = the pool on is 100 by construction: not shown (metrics of older runs may hold it)
    pool = last["self_retrieval"]["n_images"] if retrieval else 0
    ks = [k for k in last["self_retrieval"] if k.startswith("r") and int(k[1:]) < pool] if retrieval else []
    header = f"{'':<12}" + "".join(f"{name:>9}" for name in CAPTION_COLUMNS.values())
    lines = [header + ("  self-retrieval " + "".join(f"{'R@' + k[1:]:>8}" for k in ks) if retrieval else "")]
    for name, m in rows.items():
        recall = " " * 16 + "".join(f"{m['self_retrieval'][k]:>8.2f}" for k in ks) if retrieval else ""
        lines.append(f"{name:<12}" + "".join(score_cell(m["captions"][c]) for c in CAPTION_COLUMNS) + recall)
    if retrieval:
        lines.append(
            f"self-retrieval: each generated caption ranks the {last['self_retrieval']['n_images']} first "
            f"{split} images by ln p(caption | image)"
        )
    if not math.isfinite(last["captions"]["meteor"]):
        lines.append(
            "METEOR n/a: not scored (eval.meteor=false), or it did not finish within eval.meteor_timeout "
            "and was ended (a warning above says so)"
        )
    for example in last.get("examples", []):
        lines.append(f"  {example['key']}  generated: {example['generated']}")
        lines += [f"  {'':<{len(example['key'])}}  reference: {r}" for r in example["references"][:2]]
    if last.get("skipped_samples"):
        lines.append(
            f"{last['skipped_samples']} samples of the {split} split were unreadable and skipped "
            f"(see the warnings): the metrics cover the {last['n_images']} {last.get('unit', 'images')} that remain"
        )
    if last.get("images"):
        lines.append(f"pictures ({len(last['images'])}, PNG): {Path(last['images'][0]).parent}")
    return "\n".join(lines)
