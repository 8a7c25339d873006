"""LAViTeR's results table: Table 2's columns (R-precision, AIMCoS), retrieval and the captioner's
metrics per model, then the last model's captions and its generated-image grid."""

from __future__ import annotations

import math

from vldist.metrics.report import CAPTION_COLUMNS, score_cell


def laviter_report(rows: dict[str, dict], split: str) -> str:
    """LAViTeR's Table 2 columns (R-precision in percent, AIMCoS a cosine), retrieval and the
    captioner's metrics per model; then the last model's captions and its generated-image grid."""
    last = list(rows.values())[-1]
    header = (
        f"{'':<12}{'R-prec@1':>9}{'@3':>7}{'gen@1':>7}{'AIMCoS':>8}{'i2t R@1':>9}{'t2i R@1':>9}{'rsum':>8}"
        + "".join(f"{CAPTION_COLUMNS[c]:>9}" for c in ("bleu4", "meteor", "rouge_l", "cider_d"))
    )
    lines = [header]
    for name, m in rows.items():
        r, g = m["r_precision"], m.get("generated_r_precision", {})
        cells = [
            f"{r['r1']:>9.1f}",
            f"{r.get('r3', math.nan):>7.1f}",
            f"{g.get('r1', math.nan):>7.1f}",
            f"{m.get('aimcos', math.nan):>8.3f}",
            f"{m['retrieval']['i2t_r1']:>9.1f}",
            f"{m['retrieval']['t2i_r1']:>9.1f}",
            f"{m['retrieval']['rsum']:>8.1f}",
        ]
        captions = m.get("captions", {})
        cells += [score_cell(captions.get(c, math.nan)) for c in ("bleu4", "meteor", "rouge_l", "cider_d")]
        lines.append(f"{name:<12}" + "".join(cells).replace("nan", "n/a"))
    pretrained = [(name, m["label_recall"]) for name, m in rows.items() if "label_recall" in m]
    for name, recall in pretrained:
        lines.append(
            f"{name}: the trunk's top attribute words (colour, shape, size) recall {recall:.1f}% of each "
            "image's own attribute words"
        )
    lines.append(
        f"R-precision: each of the {last['n_images']} {split} images ranks its first caption among "
        f"{last['candidates']} (99 of other images in the paper's protocol); gen@1: the same for images "
        "generated from those captions"
    )
    for example in last.get("examples", []):
        lines.append(f"  {example['key']}  generated: {example['generated']}")
        lines += [f"  {'':<{len(example['key'])}}  reference: {r}" for r in example["references"][:2]]
    if last.get("images"):
        lines.append(f"generated images ({len(last.get('grid_captions', []))}, PNG): {last['images'][0]}")
        lines += [f"  {i + 1}. {caption}" for i, caption in enumerate(last.get("grid_captions", []))]
    if last.get("skipped_samples"):
        lines.append(
            f"{last['skipped_samples']} samples of the {split} split were unreadable and skipped "
            f"(see the warnings): the metrics cover the {last['n_images']} images that remain"
        )
    return "\n".join(lines)
