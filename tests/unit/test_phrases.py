"""Phrase localisation samples: training pairs by overlap, proposals read back, and the recall of
a random ranking."""

import io
import itertools
import random

import numpy as np
import pytest

from vldist.data.phrases import random_ranking_recall, read_proposals, training_pairs
from vldist.data.shardset import ShardsUnfitError
from vldist.recipes.two_branch import TwoBranchEmbedRecipe
from vldist.train import load_config

# Two objects; proposals around them at known overlaps, each row's features = its index.
OBJECTS = [{"phrase": "a red circle", "box": [0, 0, 10, 10], "region": 1},
           {"phrase": "a blue square", "box": [20, 20, 30, 30], "region": 2}]
PROPOSALS = np.array([
    [0, 0, 10, 10],     # 0: object 0 itself (IoU 1)
    [0, 0, 10, 9],      # 1: object 0, IoU 0.9
    [0, 0, 10, 6],      # 2: object 0, IoU 0.6: neither positive nor negative
    [20, 20, 30, 29],   # 3: object 1, IoU 0.9
    [40, 40, 50, 50],   # 4: no overlap: a negative
    [5, 5, 25, 25],     # 5: IoU 0.0625 with each: a negative
    [8, 0, 30, 10],     # 6: IoU 2/22 with object 0: a negative
    [22, 22, 40, 40],   # 7: IoU 64/360 with object 1: a negative
], dtype=np.float32)
FEATURES = np.arange(len(PROPOSALS), dtype=np.float32)[:, None].repeat(3, 1)
REGIONS = np.array([[-1.0] * 3, [-2.0] * 3, [-3.0] * 3], dtype=np.float32)


def test_positives_overlap_at_least_0_7_and_negatives_less_than_0_3_with_every_object():
    seen_positive = {0: set(), 1: set()}
    for seed in range(40):
        pairs = training_pairs({"objects": OBJECTS}, REGIONS, FEATURES, PROPOSALS, random.Random(seed),
                               augmented=True, negatives=3)
        assert [p["phrase"] for p in pairs] == ["a red circle", "a blue square"]
        for i, pair in enumerate(pairs):
            seen_positive[i].add(int(pair["positive"][0]))
            negatives = {int(row[0]) for row in pair["negatives"]}
            assert len(negatives) == 3 and negatives <= {4, 5, 6, 7}
    assert seen_positive == {0: {0, 1}, 1: {3}}  # a random positive at each visit (augmented)


def test_without_augmentation_the_positive_is_the_box_own_region():
    pairs = training_pairs({"objects": OBJECTS}, REGIONS, FEATURES, PROPOSALS, random.Random(0),
                           augmented=False, negatives=10)
    assert [float(p["positive"][0]) for p in pairs] == [-2.0, -3.0]
    assert all(len(p["negatives"]) == 4 for p in pairs)  # all there are, when fewer than asked


def test_a_phrase_without_positive_or_region_is_left_out():
    far = [{"phrase": "a green star", "box": [60, 60, 70, 70]}]
    assert training_pairs({"objects": OBJECTS[:1] + far}, REGIONS, FEATURES, PROPOSALS, random.Random(0),
                          augmented=True, negatives=1)[0]["phrase"] == "a red circle"
    assert len(training_pairs({"objects": far}, REGIONS, FEATURES, PROPOSALS, random.Random(0), True, 1)) == 0


def test_random_ranking_recall_equals_the_count_over_every_order():
    rows = [np.array([0.9, 0.1, 0.6, 0.2, 0.0]), np.array([0.1, 0.2, 0.3, 0.0, 0.55]), np.array([0.1, 0.2, 0.0])]
    for k in (1, 2, 4):
        rates = []
        for row in rows:
            orders = list(itertools.permutations(range(len(row))))
            rates.append(sum(any(row[i] >= 0.5 for i in order[:k]) for order in orders) / len(orders))
        assert random_ranking_recall(rows, k) == pytest.approx(100 * np.mean(rates))


def _raw(features, boxes):
    buf = io.BytesIO()
    np.save(buf, features)
    return {"__key__": "s1", "proposals.npy": buf.getvalue()}, {"proposal_boxes": boxes}


def test_proposals_are_read_back_and_bad_ones_name_the_sample():
    raw, meta = _raw(FEATURES, PROPOSALS.tolist())
    features, boxes = read_proposals(raw, meta, 3)
    assert np.array_equal(features, FEATURES) and np.array_equal(boxes, PROPOSALS)
    with pytest.raises(ValueError, match="s1 has no proposals"):
        read_proposals({"__key__": "s1"}, meta, 3)
    raw, meta = _raw(FEATURES[:5], PROPOSALS.tolist())
    with pytest.raises(ValueError, match=r"proposals.npy of s1 has shape \(5, 3\), expected \(8, F\)"):
        read_proposals(raw, meta, 3)
    raw, meta = _raw(FEATURES, PROPOSALS.tolist())
    with pytest.raises(ValueError, match="has 3 features, expected 4"):
        read_proposals(raw, meta, 4)


def test_phrases_on_a_set_without_proposals_say_how_to_add_them(planted_shards):
    config = load_config("two_branch_embed", [f"data.shards={planted_shards}", "model.tasks=[retrieval,phrases]"])
    with pytest.raises(ShardsUnfitError, match="has no proposals.*--overwrite.*model.tasks=\\[retrieval\\]"):
        TwoBranchEmbedRecipe(config, None, 6).preflight()
