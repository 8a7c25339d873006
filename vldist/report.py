"""The short results table printed after training and evaluation."""

from __future__ import annotations

from math import comb

COLUMNS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")


def chance_recall(n_images: int, captions_per_image: int = 5) -> dict[str, float]:
    """Expected recall of a random ranking: i2t finds one of its captions in the top K of all captions."""
    n_caps = n_images * captions_per_image
    out = {}
    for k in (1, 5, 10):
        out[f"i2t_r{k}"] = 100 * (1 - comb(n_caps - captions_per_image, k) / comb(n_caps, k))
        out[f"t2i_r{k}"] = 100 * min(k, n_images) / n_images
    out["rsum"] = sum(out.values())
    return out


def retrieval_table(rows: dict[str, dict[str, float]]) -> str:
    header = f"{'':<12}{'i2t R@1':>9}{'R@5':>7}{'R@10':>7}{'t2i R@1':>10}{'R@5':>7}{'R@10':>7}{'rsum':>9}"
    lines = [header]
    for name, m in rows.items():
        v = [m[c] for c in COLUMNS]
        lines.append(f"{name:<12}{v[0]:>9.1f}{v[1]:>7.1f}{v[2]:>7.1f}{v[3]:>10.1f}{v[4]:>7.1f}{v[5]:>7.1f}{v[6]:>9.1f}")
    return "\n".join(lines)
