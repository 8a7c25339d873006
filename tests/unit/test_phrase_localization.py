"""Phrase localisation recall against a brute-force reference: python IoU, a sort per phrase."""

import numpy as np
import pytest
import torch

from vldist.metrics.phrase_localization import phrase_localization_recall


def iou_by_hand(a, b):
    """IoU of two [x0, y0, x1, y1] boxes, continuous coordinates; 0 when both have zero area."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def bruteforce(scores, proposal_boxes, gt_boxes, ks, iou=0.5):
    """Sort each phrase's proposals best first, a non-covering one before a covering one at equal
    score (ties against the query); the phrase is hit at K if a covering one is in the first K."""
    n = len(scores)
    hits = {k: 0 for k in ks}
    covered = 0
    for s, boxes, gt in zip(scores, proposal_boxes, gt_boxes, strict=True):
        s = [float(v) for v in s]
        covering = [iou_by_hand([float(c) for c in box], [float(c) for c in gt]) >= iou for box in boxes]
        if any(covering):
            covered += 1
        order = sorted(range(len(s)), key=lambda j: (-s[j], covering[j]))
        for k in ks:
            if any(covering[j] for j in order[: min(k, len(s))]):
                hits[k] += 1
    out = {f"r{k}": 100.0 * hits[k] / n for k in ks}
    out["upper_bound"] = 100.0 * covered / n
    out["n_phrases"] = n
    return out


def random_case(seed, n_phrases=40, max_proposals=15, fixed=None):
    """Integer pixel boxes (exact areas); about half the proposals jitter the ground truth so that
    many, but not all, phrases are covered; scores on a coarse grid so ties are frequent."""
    rng = np.random.default_rng(seed)
    scores, boxes, gts = [], [], []
    for _ in range(n_phrases):
        x0, y0 = rng.integers(0, 60, size=2)
        gt = [x0, y0, x0 + rng.integers(1, 40), y0 + rng.integers(1, 40)]
        p = fixed if fixed is not None else int(rng.integers(0, max_proposals + 1))
        props = []
        for _ in range(p):
            if rng.random() < 0.5:
                jitter = rng.integers(-8, 9, size=4)
                box = [gt[0] + jitter[0], gt[1] + jitter[1], gt[2] + jitter[2], gt[3] + jitter[3]]
                box = [box[0], box[1], max(box[0], box[2]), max(box[1], box[3])]
            else:
                a, b = rng.integers(0, 100, size=2)
                box = [a, b, a + rng.integers(0, 40), b + rng.integers(0, 40)]
            props.append(box)
        scores.append(np.round(rng.random(p), 1))
        boxes.append(np.array(props, dtype=np.float64).reshape(p, 4))
        gts.append(gt)
    return scores, boxes, np.array(gts, dtype=np.float64)


def check(scores, boxes, gts, ks=(1, 5, 10), iou=0.5):
    got = phrase_localization_recall(scores, boxes, gts, ks=ks, iou=iou)
    expected = bruteforce(scores, boxes, gts, ks, iou)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert type(got["n_phrases"]) is int and all(type(got[f"r{k}"]) is float for k in ks)
    return got


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_variable_proposal_counts_match_bruteforce(seed):
    scores, boxes, gts = random_case(seed)
    assert len({len(s) for s in scores}) > 3  # proposal counts really vary
    got = check(scores, boxes, gts, ks=(1, 2, 5, 10, 100))
    # Not a degenerate check: recall grows with K, and some phrases are never covered.
    assert 0 < got["r1"] < got["r5"] <= got["upper_bound"] < 100
    assert got["r100"] == got["upper_bound"]  # k above every P_i: capped, every covered phrase hits
    check(scores, boxes, gts, ks=(1, 3), iou=0.3)
    check(scores, boxes, gts, ks=(1, 3), iou=1.0)


def test_tie_at_the_cut_counts_against_the_phrase():
    gt = [[0, 0, 10, 10]]
    boxes = [
        np.array(
            [
                [50, 50, 60, 60],  # non-covering
                [0, 0, 10, 10],  # covering
                [20, 20, 30, 30],
            ]
        )
    ]  # non-covering, lower
    scores = [np.array([0.7, 0.7, 0.1])]  # the covering proposal ties a non-covering one
    got = check(scores, boxes, gt, ks=(1, 2, 3))
    assert got["r1"] == 0.0 and got["r2"] == 100.0
    # A model that scores every proposal alike ranks the covering one last.
    got = check([np.full(3, 0.2)], boxes, gt, ks=(1, 2, 3))
    assert got["r2"] == 0.0 and got["r3"] == 100.0


def test_two_covering_proposals_tied_at_the_top_are_a_hit():
    gt = [[0, 0, 10, 10]]
    boxes = [np.array([[0, 0, 10, 10], [0, 0, 10, 9], [50, 50, 60, 60]])]  # two covering
    got = check([np.array([0.9, 0.9, 0.1])], boxes, gt, ks=(1,))
    assert got["r1"] == 100.0  # whichever covering proposal comes first, the top 1 is right


def test_uncovered_phrases_stay_in_the_denominator():
    gts = [[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10]]
    boxes = [
        np.array([[0, 0, 10, 10]]),  # covered, top 1
        np.array([[40, 40, 50, 50]]),  # no proposal covers it
        np.zeros((0, 4)),  # no proposals at all
        np.array([[0, 0, 10, 4]]),
    ]  # IoU 0.4: not covered
    scores = [np.array([1.0]), np.array([1.0]), np.array([]), np.array([1.0])]
    got = check(scores, boxes, gts, ks=(1, 5))
    assert got == {"r1": 25.0, "r5": 25.0, "upper_bound": 25.0, "n_phrases": 4}


def test_iou_exactly_at_the_threshold_counts():
    gt = [[0, 0, 10, 10]]
    half = [np.array([[0, 0, 10, 5]])]  # intersection 50, union 100: IoU exactly 0.5
    assert iou_by_hand([0, 0, 10, 5], gt[0]) == 0.5
    assert check([np.array([3.0])], half, gt, ks=(1,))["r1"] == 100.0
    assert phrase_localization_recall([np.array([3.0])], half, gt, ks=(1,), iou=0.5000001)["r1"] == 0.0
    # Continuous coordinates, no +1: [0, 0, 10, 10] has area 100, so [0, 0, 5, 10] vs it is 0.5 too.
    assert phrase_localization_recall([[3.0]], [[[0, 0, 5, 10]]], gt, ks=(1,))["r1"] == 100.0


def test_padded_form_equals_list_form():
    scores, boxes, gts = random_case(7, n_phrases=20, fixed=6)
    ref = check(scores, boxes, gts, ks=(1, 5, 10))
    padded_scores, padded_boxes = np.stack(scores), np.stack(boxes)
    assert padded_scores.shape == (20, 6) and padded_boxes.shape == (20, 6, 4)
    assert phrase_localization_recall(padded_scores, padded_boxes, gts) == ref
    assert (
        phrase_localization_recall(
            torch.from_numpy(padded_scores), torch.from_numpy(padded_boxes), torch.from_numpy(gts)
        )
        == ref
    )
    assert phrase_localization_recall(padded_scores, padded_boxes, gts.tolist()) == ref
    # Per-phrase tensors and bf16 scores (0.0 .. 1.0 in steps of 0.1 stay ordered in bf16).
    listed = phrase_localization_recall(
        [torch.from_numpy(s).bfloat16() for s in scores], [torch.from_numpy(b).float() for b in boxes], gts
    )
    assert listed == ref


def test_default_ks_and_keys():
    scores, boxes, gts = random_case(3, n_phrases=10)
    got = phrase_localization_recall(scores, boxes, gts)
    assert set(got) == {"r1", "r5", "r10", "upper_bound", "n_phrases"} and got["n_phrases"] == 10


# --- validation ---

GT = [[0, 0, 10, 10], [5, 5, 8, 9]]
BOXES = [np.array([[0, 0, 10, 10], [1, 1, 2, 2]]), np.array([[5, 5, 8, 9]])]
SCORES = [np.array([0.5, 0.1]), np.array([0.3])]


@pytest.mark.parametrize(
    "scores,boxes,gt,match",
    [
        (SCORES[:1], BOXES, GT, r"proposal_boxes has 2 entries but scores has 1"),
        (SCORES, BOXES, GT[:1], r"gt_boxes must have shape \(n_phrases, 4\) = \(2, 4\)"),
        (SCORES, BOXES, [[0, 0, 10], [5, 5, 8]], r"gt_boxes must have shape .*\[x0, y0, x1, y1\]"),
        (SCORES, BOXES, [[0, 0, 10, 10], [5, 5, 8]], r"gt_boxes must be \(n_phrases, 4\)"),
        (SCORES, BOXES, [[10, 0, 0, 10], [5, 5, 8, 9]], r"gt_boxes\[0\] .* x1 < x0 or y1 < y0"),
        (SCORES, BOXES, [[0, 0, 10, 10], [5, 5, 8, np.nan]], r"gt_boxes\[1\] .* not finite"),
        (SCORES, [BOXES[0], np.array([[5, 9, 8, 5]])], GT, r"proposal_boxes\[1\]\[0\] .* y1 < y0"),
        (SCORES, [BOXES[0], np.array([[5, 5, 8]])], GT, r"proposal_boxes\[1\] must have shape \(P_i, 4\) = \(1, 4\)"),
        (
            SCORES,
            [BOXES[0], BOXES[0]],
            GT,
            r"proposal_boxes\[1\] must have shape \(P_i, 4\) = \(1, 4\) to match scores\[1\]",
        ),
        ([SCORES[0], np.array([np.nan])], BOXES, GT, r"scores\[1\] contains NaN"),
        ([SCORES[0], np.array([[0.3]])], BOXES, GT, r"scores\[1\] must be 1-D"),
        (np.array([0.5, 0.3]), BOXES, GT, r"list of 1-D arrays .* 2-D \(n_phrases, P\)"),
        (np.zeros((2, 1, 1)), BOXES, GT, r"list of 1-D arrays .* 2-D \(n_phrases, P\)"),
        (np.zeros((2, 2)), np.zeros((2, 3, 4)), GT, r"\(n_phrases, P, 4\) = \(2, 2, 4\)"),
        ([], [], np.zeros((0, 4)), r"no phrases.*n_phrases >= 1"),
    ],
)
def test_bad_inputs_say_what_is_wrong(scores, boxes, gt, match):
    with pytest.raises(ValueError, match=match):
        phrase_localization_recall(scores, boxes, gt)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ks": (0,)}, "ks"),
        ({"ks": ()}, "ks"),
        ({"ks": (1.5,)}, "ks"),
        ({"ks": (True,)}, "ks"),
        ({"iou": 0.0}, r"iou .*\(0, 1\]"),
        ({"iou": 1.5}, "iou"),
        ({"iou": float("nan")}, "iou"),
        ({"iou": True}, "iou"),
        ({"iou": "0.5"}, "iou"),
    ],
)
def test_bad_ks_and_iou(kwargs, match):
    with pytest.raises(ValueError, match=match):
        phrase_localization_recall(SCORES, BOXES, GT, **kwargs)
