"""Retrieval metrics against hand-computed ranks and a brute-force VSE++ reimplementation."""

import numpy as np
import pytest
import torch

from vldist.metrics import retrieval_protocols, retrieval_recall

KEYS = {"i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "i2t_meanr",
        "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "t2i_meanr", "rsum"}


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
        sims[i, i * 5:(i + 1) * 5] = -1.0  # four weak captions, below every negative
        sims[i, i * 5 + 2] = 1.0           # one caption ranked first
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
    return {f"{prefix}_r1": 100.0 * np.mean(ranks < 1), f"{prefix}_r5": 100.0 * np.mean(ranks < 5),
            f"{prefix}_r10": 100.0 * np.mean(ranks < 10),
            f"{prefix}_medr": np.floor(np.median(ranks)) + 1, f"{prefix}_meanr": ranks.mean() + 1}


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

@pytest.mark.parametrize("sims,cpi,match", [
    (np.zeros(10), 5, "2-D"),
    (np.zeros((2, 3, 4)), 5, "2-D"),
    (np.zeros((4, 19)), 5, r"\(4, 20\)"),
    (np.zeros((4, 4)), 5, r"expected \(n_images, n_images\*5\)"),
    (np.zeros((0, 0)), 5, "n_images >= 1"),
    (np.zeros((3, 3)), 0, "captions_per_image"),
])
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
