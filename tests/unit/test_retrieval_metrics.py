"""Retrieval metrics against hand-computed ranks and brute-force references (VSE++ and a sort per query)."""

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from vldist.metrics import retrieval_protocols, retrieval_recall
from vldist.metrics.report import chance_recall

KEYS = {
    "i2t_r1",
    "i2t_r5",
    "i2t_r10",
    "i2t_medr",
    "i2t_meanr",
    "t2i_r1",
    "t2i_r5",
    "t2i_r10",
    "t2i_medr",
    "t2i_meanr",
    "rsum",
}


def perfect(n_images, cpi):
    """Each image scores 1 with its own captions and 0 with every other caption."""
    return np.kron(np.eye(n_images), np.ones((1, cpi)))


def test_perfect_matrix():
    out = retrieval_recall(perfect(4, 5), captions_per_image=5)
    assert set(out) == KEYS
    assert all(type(v) is float for v in out.values())
    for d in ("i2t", "t2i"):
        assert out[f"{d}_r1"] == out[f"{d}_r5"] == out[f"{d}_r10"] == 100.0
        assert out[f"{d}_medr"] == 1.0 and out[f"{d}_meanr"] == 1.0
    assert out["rsum"] == 600.0


def test_image_zero_best_caption_is_rank_three():
    sims = np.eye(12)  # one caption per image, ground truth scores 1
    sims[0, 5], sims[0, 7] = 2.0, 1.5  # two negatives beat image 0's caption -> rank 3
    out = retrieval_recall(sims, captions_per_image=1)
    # i2t ranks: [3, 1 x 11]
    assert out["i2t_r1"] == pytest.approx(100 * 11 / 12)
    assert out["i2t_r5"] == out["i2t_r10"] == 100.0
    assert out["i2t_medr"] == 1.0
    assert out["i2t_meanr"] == pytest.approx((3 + 11) / 12)
    # t2i: captions 5 and 7 now find image 0 above their own image -> rank 2 each.
    assert out["t2i_r1"] == pytest.approx(100 * 10 / 12)
    assert out["t2i_meanr"] == pytest.approx((2 + 2 + 10) / 12)
    assert out["rsum"] == pytest.approx(100 * 11 / 12 + 200 + 100 * 10 / 12 + 200)


def test_rank_three_drops_out_of_r1_but_not_r5():
    sims = np.zeros((6, 6))
    np.fill_diagonal(sims, 1.0)
    sims[0, 1:3] = 2.0  # ranks [3, 1, ...]: R@1 loses image 0, R@5 keeps it
    out = retrieval_recall(sims, 1)
    assert out["i2t_r1"] == pytest.approx(100 * 5 / 6) and out["i2t_r5"] == 100.0


def test_median_is_floored_and_mean_rank():
    # Row i puts its first i non-ground-truth columns above the ground truth -> i2t ranks 1,2,3,4.
    sims = -np.ones((4, 4))
    np.fill_diagonal(sims, 0.0)
    for i in range(4):
        sims[i, [j for j in range(4) if j != i][:i]] = 1.0
    out = retrieval_recall(sims, 1)
    assert out["i2t_medr"] == 2.0  # median 2.5 floored
    assert out["i2t_meanr"] == 2.5
    assert out["i2t_r1"] == 25.0
    # Column 0 is beaten by rows 1,2,3; column 1 by rows 2,3; column 2 by row 3 -> ranks 4,3,2,1.
    assert out["t2i_medr"] == 2.0 and out["t2i_meanr"] == 2.5 and out["t2i_r1"] == 25.0


def test_constant_matrix_gets_pessimistic_ranks():
    out = retrieval_recall(np.full((4, 20), 0.3), captions_per_image=5)
    # i2t: all 15 other captions tie with the best GT caption -> rank 16.
    assert out["i2t_r1"] == out["i2t_r5"] == out["i2t_r10"] == 0.0
    assert out["i2t_medr"] == 16.0 and out["i2t_meanr"] == 16.0
    # t2i: all 3 other images tie with the true one -> rank 4.
    assert out["t2i_r1"] == 0.0 and out["t2i_r5"] == out["t2i_r10"] == 100.0
    assert out["t2i_medr"] == 4.0 and out["t2i_meanr"] == 4.0
    assert out["rsum"] == 200.0


def test_tie_with_one_negative_counts_as_rank_two():
    sims = np.eye(5)
    sims[0, 3] = 1.0  # image 0 scores caption 3 exactly as high as its own caption
    out = retrieval_recall(sims, 1)
    assert out["i2t_r1"] == 80.0 and out["i2t_meanr"] == pytest.approx(6 / 5)
    assert out["t2i_r1"] == 80.0 and out["t2i_meanr"] == pytest.approx(6 / 5)  # caption 3 too


def test_one_of_five_captions_ranked_first_is_enough_for_i2t():
    sims = np.zeros((3, 15))
    for i in range(3):
        sims[i, i * 5 : (i + 1) * 5] = -1.0  # four weak captions, below every negative
        sims[i, i * 5 + 2] = 1.0  # one caption ranked first
    out = retrieval_recall(sims, 5)
    assert out["i2t_r1"] == 100.0 and out["i2t_medr"] == 1.0
    # t2i: the 3 strong captions rank 1; the 12 weak ones (true -1, others 0) rank 3.
    assert out["t2i_r1"] == 20.0 and out["t2i_r5"] == 100.0
    assert out["t2i_medr"] == 3.0
    assert out["t2i_meanr"] == pytest.approx((3 * 1 + 12 * 3) / 15)


# --- brute-force VSE++ evaluation (evaluation.py i2t/t2i), written per query with argsort ---


def vsepp_i2t(sims, cpi):
    ranks = np.zeros(sims.shape[0])
    for index in range(sims.shape[0]):
        inds = np.argsort(sims[index])[::-1]
        ranks[index] = min(np.where(inds == i)[0][0] for i in range(cpi * index, cpi * index + cpi))
    return ranks  # 0-based


def vsepp_t2i(sims, cpi):
    ranks = np.zeros(sims.shape[1])
    for col in range(sims.shape[1]):
        inds = np.argsort(sims[:, col])[::-1]
        ranks[col] = np.where(inds == col // cpi)[0][0]
    return ranks


def vsepp_metrics(ranks, prefix):
    return {
        f"{prefix}_r1": 100.0 * np.mean(ranks < 1),
        f"{prefix}_r5": 100.0 * np.mean(ranks < 5),
        f"{prefix}_r10": 100.0 * np.mean(ranks < 10),
        f"{prefix}_medr": np.floor(np.median(ranks)) + 1,
        f"{prefix}_meanr": ranks.mean() + 1,
    }


@pytest.mark.parametrize("n_images,cpi,seed", [(40, 5, 0), (300, 2, 1), (25, 1, 2)])
def test_matches_bruteforce_vsepp(n_images, cpi, seed):
    # 300 images exceeds one chunk of rows, so chunk boundaries are exercised too.
    rng = np.random.default_rng(seed)
    # Weakly informative scores so ranks are spread out rather than all 1.
    sims = rng.normal(size=(n_images, n_images * cpi))
    sims += 1.5 * perfect(n_images, cpi)
    expected = vsepp_metrics(vsepp_i2t(sims, cpi), "i2t")
    expected.update(vsepp_metrics(vsepp_t2i(sims, cpi), "t2i"))
    expected["rsum"] = sum(v for k, v in expected.items() if "_r" in k and k[-1].isdigit())
    out = retrieval_recall(sims, cpi)
    assert 0 < out["i2t_r1"] < 100 and out["t2i_medr"] >= 1
    for k in KEYS:
        assert out[k] == pytest.approx(expected[k], abs=1e-9), k


def test_torch_input_any_dtype():
    rng = np.random.default_rng(3)
    sims = rng.normal(size=(10, 50)).astype(np.float32) + 2 * perfect(10, 5).astype(np.float32)
    ref = retrieval_recall(sims)
    assert retrieval_recall(torch.from_numpy(sims)) == ref
    assert retrieval_recall(torch.from_numpy(sims).to(torch.bfloat16))["i2t_r1"] >= 0  # no crash


# --- MS-COCO 1K protocol ---


def test_1k_five_fold_average_of_known_fold_recalls():
    n, fold = 5000, 1000
    sims = np.eye(n, dtype=np.float32)
    wrong = [0, 100, 200, 300, 400]  # fold f gets `wrong[f]` images with a distractor
    for f, w in enumerate(wrong):
        start = f * fold + fold - w  # the last w images of fold f
        for i in range(start, start + w):
            # Cyclic shift inside the wrong block: each wrong image outranks its GT with a distinct
            # caption of the same fold, so that caption's query also ranks its own image 2nd.
            sims[i, start + (i - start + 1) % w] = 2.0
    # Cross-fold distractor (image 0 vs caption 1000): hurts "full" only, invisible to the folds.
    sims[0, fold] = 5.0
    out = retrieval_protocols(sims, captions_per_image=1)
    per_fold_r1 = [100.0 * (fold - w) / fold for w in wrong]  # 100, 90, 80, 70, 60
    k5 = out["1k_5fold"]
    assert k5["i2t_r1"] == pytest.approx(np.mean(per_fold_r1)) == pytest.approx(80.0)
    assert k5["t2i_r1"] == pytest.approx(80.0)
    assert k5["i2t_r5"] == k5["t2i_r5"] == 100.0
    assert k5["i2t_medr"] == 1.0
    assert k5["i2t_meanr"] == pytest.approx(np.mean([1 + w / fold for w in wrong]))
    assert k5["rsum"] == pytest.approx(80 * 2 + 400)
    # Full 5K: the same 1000 wrong images plus image 0 and caption 1000 (cross-fold).
    assert out["full"]["i2t_r1"] == pytest.approx(100.0 * (n - 1000 - 1) / n)
    assert out["full"]["t2i_r1"] == pytest.approx(100.0 * (n - 1000 - 1) / n)


def test_folds_take_each_images_captions():
    # 5 folds of 2 images, 5 captions each. In-fold blocks are perfect; everything outside the
    # fold blocks scores 3 so a fold sliced with the wrong captions would rank badly.
    fold, cpi = 2, 5
    sims = np.full((10, 50), 3.0)
    for f in range(5):
        r, c = slice(f * fold, (f + 1) * fold), slice(f * fold * cpi, (f + 1) * fold * cpi)
        sims[r, c] = perfect(fold, cpi)
    sims[0, 5] = 2.0  # in fold 0, image 0 prefers one of image 1's captions
    k5 = retrieval_protocols(sims, cpi, fold_size=fold)["1k_5fold"]
    assert k5["i2t_r1"] == pytest.approx((50 + 4 * 100) / 5)  # fold 0: 1 of 2 images right
    assert k5["t2i_r1"] == pytest.approx((90 + 4 * 100) / 5)  # fold 0: caption 5 ranks 2nd
    assert k5["i2t_r5"] == 100.0


def test_no_1k_protocol_below_five_folds():
    sims = perfect(9, 5)
    out = retrieval_protocols(sims, 5, fold_size=2)
    assert set(out) == {"full"} and out["full"] == retrieval_recall(sims, 5)
    assert set(retrieval_protocols(perfect(10, 5), 5, fold_size=2)) == {"full", "1k_5fold"}
    assert set(retrieval_protocols(perfect(30, 1), 1)) == {"full"}  # default fold_size=1000


# --- validation ---


@pytest.mark.parametrize(
    "sims,cpi,match",
    [
        (np.zeros(10), 5, "2-D"),
        (np.zeros((2, 3, 4)), 5, "2-D"),
        (np.zeros((4, 19)), 5, r"\(4, 20\)"),
        (np.zeros((4, 4)), 5, r"expected \(n_images, n_images\*5\)"),
        (np.zeros((0, 0)), 5, "n_images >= 1"),
        (np.zeros((3, 3)), 0, "captions_per_image"),
    ],
)
def test_shape_errors_name_expected_shape(sims, cpi, match):
    with pytest.raises(ValueError, match=match):
        retrieval_recall(sims, cpi)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(bad):
    sims = perfect(3, 5)
    sims[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        retrieval_recall(sims)
    with pytest.raises(ValueError, match="NaN or infinite"):
        retrieval_protocols(sims)


def test_bad_fold_size():
    with pytest.raises(ValueError, match="fold_size"):
        retrieval_protocols(perfect(3, 5), fold_size=0)


# --- any number of captions per image (`caption_images`) ---


def brute_ranks(sims, caption_images):
    """1-based i2t and t2i ranks by sorting every query's candidates; ties go against the query."""
    sims, caption_images = np.asarray(sims).tolist(), list(caption_images)
    n_images, n_captions = len(sims), len(caption_images)
    i2t = []
    for i in range(n_images):
        # Best score first; at equal score a caption of image i goes after the other captions.
        order = sorted(range(n_captions), key=lambda j: (-sims[i][j], caption_images[j] == i))
        i2t.append(next(pos for pos, j in enumerate(order, 1) if caption_images[j] == i))
    t2i = []
    for j in range(n_captions):
        true = caption_images[j]
        order = sorted(range(n_images), key=lambda i: (-sims[i][j], i == true))
        t2i.append(order.index(true) + 1)
    return i2t, t2i


def brute_metrics(sims, caption_images):
    out = {}
    for prefix, ranks in zip(("i2t", "t2i"), brute_ranks(sims, caption_images), strict=True):
        for k in (1, 5, 10):
            out[f"{prefix}_r{k}"] = 100 * sum(r <= k for r in ranks) / len(ranks)
        s, m = sorted(ranks), len(ranks)
        out[f"{prefix}_medr"] = float(s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) // 2)
        out[f"{prefix}_meanr"] = sum(ranks) / m
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out


def mixed_set(n_images, seed, counts=(1, 2, 5)):
    """Images with 1, 2 or 5 captions, the captions shuffled into a random column order."""
    rng = np.random.default_rng(seed)
    per_image = rng.choice(counts, size=n_images)
    caption_images = rng.permutation(np.repeat(np.arange(n_images), per_image))
    n_captions = len(caption_images)
    sims = rng.normal(size=(n_images, n_captions))
    sims[caption_images, np.arange(n_captions)] += 1.5  # weakly informative: ranks spread out
    # One decimal: a few dozen distinct scores, so ground truths tie with negatives all the time.
    return np.round(sims, 1), caption_images, per_image


@pytest.mark.parametrize("n_images,seed", [(40, 0), (40, 1), (300, 2)])
def test_mixed_caption_counts_match_bruteforce(n_images, seed):
    # 300 images exceed one chunk of rows (256), so chunk boundaries are exercised too.
    sims, caption_images, per_image = mixed_set(n_images, seed)
    assert set(per_image.tolist()) == {1, 2, 5}
    # Deliberate ties: image 0's best caption ties with one negative and caption 0's true image
    # ties with another image, on top of the many ties from rounding.
    own0 = np.flatnonzero(caption_images == 0)
    neg0 = np.flatnonzero(caption_images != 0)[0]
    sims[0, neg0] = sims[0, own0].max()
    sims[(caption_images[0] + 1) % n_images, 0] = sims[caption_images[0], 0]
    expected = brute_metrics(sims, caption_images)
    out = retrieval_recall(sims, caption_images=caption_images)
    assert set(out) == KEYS and all(type(v) is float for v in out.values())
    assert 0 < out["i2t_r1"] < 100 and 0 < out["t2i_r1"] < 100
    for k in KEYS:
        assert out[k] == pytest.approx(expected[k], abs=1e-9), k
    # Both directions are sensitive to the tie rule: breaking ties for the query scores better.
    best_own = [sims[i, caption_images == i].max() for i in range(n_images)]
    optimistic_i2t = [1 + np.sum((sims[i] > best_own[i]) & (caption_images != i)) for i in range(n_images)]
    assert np.mean(optimistic_i2t) < out["i2t_meanr"]


def test_one_caption_per_image_in_random_order():
    # Image i's caption sits in column perm[i]; image 2 prefers the caption of image 0.
    perm = np.array([3, 0, 4, 1, 2])
    caption_images = np.argsort(perm)  # caption in column perm[i] describes image i
    sims = np.zeros((5, 5))
    sims[np.arange(5), perm] = 1.0
    sims[2, perm[0]] = 2.0
    out = retrieval_recall(sims, caption_images=caption_images)
    assert out["i2t_r1"] == 80.0 and out["i2t_meanr"] == pytest.approx(6 / 5)  # image 2: rank 2
    assert out["t2i_r1"] == 80.0 and out["t2i_meanr"] == pytest.approx(6 / 5)  # caption of image 0


@pytest.mark.parametrize("n_images,cpi,seed", [(40, 5, 0), (300, 2, 1), (25, 1, 2)])
def test_regular_layout_as_caption_images_is_identical(n_images, cpi, seed):
    rng = np.random.default_rng(seed)
    sims = np.round(rng.normal(size=(n_images, n_images * cpi)) + 1.5 * perfect(n_images, cpi), 1)
    caption_images = np.repeat(np.arange(n_images), cpi)
    ref = retrieval_recall(sims, cpi)
    assert retrieval_recall(sims, caption_images=caption_images) == ref
    assert retrieval_recall(sims, caption_images=caption_images.tolist()) == ref
    assert retrieval_recall(sims, caption_images=torch.from_numpy(caption_images)) == ref
    # Column order does not matter as long as caption_images follows the columns.
    perm = rng.permutation(n_images * cpi)
    assert retrieval_recall(sims[:, perm], caption_images=caption_images[perm]) == ref
    ref_protocols = retrieval_protocols(sims, cpi, fold_size=5)
    assert "1k_5fold" in ref_protocols
    assert retrieval_protocols(sims[:, perm], cpi, 5, caption_images=caption_images[perm]) == ref_protocols


def test_captions_per_image_is_ignored_with_caption_images():
    sims, caption_images, _ = mixed_set(12, 3)
    ref = retrieval_recall(sims, caption_images=caption_images)
    assert retrieval_recall(sims, 3, caption_images=caption_images) == ref
    assert retrieval_protocols(sims, 7, 2, caption_images=caption_images)["full"] == ref


def test_1k_folds_by_images_with_variable_caption_counts():
    # 23 images: 5 folds of 4 images, the last 3 images belong to no fold.
    fold = 4
    sims, caption_images, _ = mixed_set(23, 4)
    out = retrieval_protocols(sims, fold_size=fold, caption_images=caption_images)
    per_fold = []
    for f in range(5):
        images = range(f * fold, (f + 1) * fold)
        cols = [j for j, i in enumerate(caption_images) if i in images]
        sub = [[sims[i, j] for j in cols] for i in images]
        per_fold.append(brute_metrics(sub, [caption_images[j] - f * fold for j in cols]))
    assert set(out) == {"full", "1k_5fold"}
    for k in KEYS:
        assert out["1k_5fold"][k] == pytest.approx(np.mean([m[k] for m in per_fold]), abs=1e-9), k
    assert out["full"] == pytest.approx(brute_metrics(sims, caption_images), abs=1e-9)
    # Folds of 4 images are far easier than all 23: the two results must really differ.
    assert out["1k_5fold"]["rsum"] > out["full"]["rsum"]


@pytest.mark.parametrize(
    "caption_images,match",
    [
        ([0, 0, 2, 2], r"image 1 has no caption"),
        ([0, 1, 1, 1], r"image 2 has no caption.*i2t is undefined"),
        ([0, 1, 3, 2], r"caption_images\[2\] = 3 is out of range.*0\.\.2"),
        ([0, -1, 1, 2], r"caption_images\[1\] = -1 is out of range"),
        ([0, 1, 2], r"one image index per caption \(sims.shape\[1\] = 4\), got shape \(3,\)"),
        ([[0, 1, 2, 2]], r"1-D"),
        ([0.0, 1.0, 2.0, 2.0], r"integer image indices"),
        ([True, False, True, True], r"integer image indices"),
    ],
)
def test_bad_caption_images_say_what_is_wrong(caption_images, match):
    sims = np.zeros((3, 4))
    with pytest.raises(ValueError, match=match):
        retrieval_recall(sims, caption_images=caption_images)
    with pytest.raises(ValueError, match=match):
        retrieval_protocols(sims, caption_images=np.array(caption_images))


def test_caption_images_sims_checks():
    with pytest.raises(ValueError, match=r"2-D \(n_images x n_captions\)"):
        retrieval_recall(np.zeros(4), caption_images=[0, 0, 0, 0])
    with pytest.raises(ValueError, match="n_images >= 1"):
        retrieval_recall(np.zeros((0, 2)), caption_images=[0, 0])
    sims = np.eye(3)
    sims[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        retrieval_recall(sims, caption_images=[0, 1, 2])


# --- chance level ---


def exact_chance_by_enumeration(caption_counts, k):
    """i2t/t2i R@K of a uniformly random ranking, by enumerating every top-K set / image order."""
    owner = [i for i, c in enumerate(caption_counts) for _ in range(c)]
    n_images, n_caps = len(caption_counts), len(owner)
    tops = list(itertools.combinations(range(n_caps), min(k, n_caps)))
    i2t = Fraction(
        sum(sum(any(owner[j] == i for j in top) for top in tops) for i in range(n_images)), n_images * len(tops)
    )
    orders = list(itertools.permutations(range(n_images)))
    t2i = Fraction(sum(order.index(0) < k for order in orders), len(orders))
    return 100 * i2t, 100 * t2i


@pytest.mark.parametrize("caption_counts", [[1, 2, 5, 1, 3], [5, 5], [1] * 6, [2, 1, 1, 1, 1, 1, 1, 1, 1]])
def test_chance_recall_with_caption_counts_matches_enumeration(caption_counts):
    out = chance_recall(len(caption_counts), caption_counts=caption_counts)
    for k in (1, 5, 10):
        i2t, t2i = exact_chance_by_enumeration(caption_counts, k)
        assert out[f"i2t_r{k}"] == pytest.approx(float(i2t), rel=1e-12), k
        assert out[f"t2i_r{k}"] == pytest.approx(float(t2i), rel=1e-12), k
    assert out["rsum"] == pytest.approx(sum(v for key, v in out.items() if key != "rsum"))


def test_chance_recall_coco_size_matches_product_form():
    rng = np.random.default_rng(0)
    counts = rng.choice([1, 2, 5, 7], size=5000)
    n_caps = int(counts.sum())
    out = chance_recall(5000, caption_counts=counts)
    for k in (1, 5, 10):
        # P(no caption of the image in the top K) = prod_t (N - c - t) / (N - t).
        miss = [np.prod([(n_caps - c - t) / (n_caps - t) for t in range(k)]) for c in counts]
        assert out[f"i2t_r{k}"] == pytest.approx(100 * (1 - np.mean(miss)), rel=1e-9), k
        assert out[f"t2i_r{k}"] == pytest.approx(100 * k / 5000)


def test_chance_recall_regular_layout_unchanged():
    for n, cpi in [(5000, 5), (1000, 5), (31783, 1), (7, 2)]:
        assert chance_recall(n, cpi) == chance_recall(n, 3, caption_counts=[cpi] * n)
    # One caption per image: i2t R@K = K / N exactly, like t2i.
    assert chance_recall(5000, 1)["i2t_r1"] == pytest.approx(100 / 5000, rel=1e-15)
    assert chance_recall(5000, 1)["i2t_r10"] == pytest.approx(100 * 10 / 5000, rel=1e-15)
    # Fewer captions than K: every caption is in the top K.
    assert chance_recall(1, 5)["i2t_r10"] == 100.0


def test_chance_recall_bad_caption_counts():
    with pytest.raises(ValueError, match="image 1 has caption count 0"):
        chance_recall(3, caption_counts=[1, 0, 2])
    with pytest.raises(ValueError, match=r"3 entries; expected one per image \(n_images=4\)"):
        chance_recall(4, caption_counts=[1, 1, 2])
    with pytest.raises(ValueError, match="integer counts"):
        chance_recall(2, caption_counts=[1, 2.5])
