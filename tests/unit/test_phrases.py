"""Phrase localisation samples: training rows by overlap and coreference chain (the paper's
Algorithm 1), proposals read back, and the recall of a random ranking."""

import io
import itertools
import random

import numpy as np
import pytest

from vldist.data.phrases import chains, random_ranking_recall, read_proposals, training_image
from vldist.data.shardset import ShardSet
from vldist.errors import ShardsUnfitError
from vldist.recipes.jobs import load_config
from vldist.recipes.two_branch import TwoBranchEmbedRecipe

OBJECTS = [
    {"phrase": "a red circle", "box": [0, 0, 10, 10], "region": 1},
    {"phrase": "a blue square", "box": [20, 20, 30, 30], "region": 2},
]
PROPOSALS = np.array(
    [
        [0, 0, 10, 10],  # 0: object 0 itself (IoU 1)
        [0, 0, 10, 9],  # 1: object 0, IoU 0.9
        [0, 0, 10, 6],  # 2: object 0, IoU 0.6: neither positive nor negative of it
        [20, 20, 30, 29],  # 3: object 1, IoU 0.9
        [40, 40, 50, 50],  # 4: no overlap: a negative of both
        [5, 5, 25, 25],  # 5: IoU 0.0625 with each: a negative of both
        [8, 0, 30, 10],  # 6: IoU 2/22 with object 0: a negative of both
        [22, 22, 40, 40],  # 7: IoU 64/360 with object 1: a negative of both
    ],
    dtype=np.float32,
)
FEATURES = np.arange(len(PROPOSALS), dtype=np.float32)[:, None].repeat(3, 1)
REGIONS = np.array([[-1.0] * 3, [-2.0] * 3, [-3.0] * 3], dtype=np.float32)
# Algorithm 1, 3.b: a phrase's negatives are the proposals of IoU < 0.3 with its own box; the
# other object's proposals are among them (the paper's "IoU < 0.3 with the ground truth")
OWN_NEGATIVES = {0: {3, 4, 5, 6, 7}, 1: {0, 1, 2, 4, 5, 6, 7}}


def image(objects=OBJECTS, seed=0, augmented=True, negatives=3, proposals=PROPOSALS):
    features = np.arange(len(proposals), dtype=np.float32)[:, None].repeat(3, 1)
    return training_image({"objects": objects}, REGIONS, features, proposals, random.Random(seed), augmented, negatives)


def drawn_for(rows: dict, phrase: int) -> set[int]:
    """The proposals drawn for a phrase (pool rows carry their proposal index as features)."""
    return {int(rows["negatives"][n][0]) for m, n in rows["drawn"] if m == phrase}


def listed_for(rows: dict, phrase: int) -> set[int]:
    return {int(rows["negatives"][n][0]) for m, n in rows["region_negatives"] if m == phrase}


def test_positives_overlap_at_least_0_7_and_negatives_less_than_0_3_with_the_phrase_box():
    seen_positive, seen_negative = {0: set(), 1: set()}, {0: set(), 1: set()}
    for seed in range(40):
        rows = image(seed=seed)
        assert rows["phrases"] == ["a red circle", "a blue square"] and rows["entity"].tolist() == [0, 1]
        assert rows["box"].tolist() == [o["box"] for o in OBJECTS]
        for i in range(2):
            seen_positive[i].add(int(rows["positive"][i][0]))
            assert rows["positive_box"][i].tolist() == PROPOSALS[int(rows["positive"][i][0])].tolist()
            drawn = drawn_for(rows, i)
            assert len(drawn) == 3 and drawn <= OWN_NEGATIVES[i]
            seen_negative[i] |= drawn
            # the pool is every draw of the image; each phrase may take all of it that is its negative
            pool = {int(f[0]) for f in rows["negatives"]}
            assert listed_for(rows, i) == pool & OWN_NEGATIVES[i]
        assert rows["negative_box"].tolist() == PROPOSALS[rows["negatives"][:, 0].astype(int)].tolist()
    assert seen_positive == {0: {0, 1}, 1: {3}}  # a random positive at each visit (augmented)
    assert seen_negative == OWN_NEGATIVES  # every one of them is drawn in time


def test_all_takes_every_negative_of_each_phrase():
    rows = image(negatives="all")
    assert {int(f[0]) for f in rows["negatives"]} == set(range(8))  # 2 is object 1's negative, 0 and 1 too
    for i in range(2):
        assert drawn_for(rows, i) == listed_for(rows, i) == OWN_NEGATIVES[i]


def test_a_region_positive_for_a_phrase_of_the_same_chain_is_no_negative():
    """One entity, two phrases with two boxes (an entity Flickr30K Entities would box twice, kept
    apart here): a proposal on either box is a negative of neither phrase; another entity's are."""
    objects = [
        {**OBJECTS[0], "entity": "7"},
        {**OBJECTS[1], "entity": "7"},
        {"phrase": "a green star", "box": [40, 40, 50, 50], "entity": "8"},
    ]
    assert chains(objects) == [0, 0, 1]
    rows = image(objects, negatives="all")
    assert rows["entity"].tolist() == [0, 0, 1]
    for i in (0, 1):
        # 0-3 overlap one of the two boxes; 4 is the star's own box
        assert listed_for(rows, i) == drawn_for(rows, i) == {4, 5, 6, 7}
    assert listed_for(rows, 2) == {0, 1, 2, 3, 5, 6, 7}
    # phrases: 0 and 1 are one chain, so neither is the other's negative; the star is both's
    assert sorted(map(tuple, rows["phrase_negatives"].tolist())) == [(0, 2), (1, 2), (2, 0), (2, 1)]


def test_two_entities_of_one_box_are_not_each_other_negatives():
    """Flickr30K Entities can name two entities in one box ("the stairs", "the steps"): a region
    positive for one is positive for the other, so the other phrase is no negative of it (3.a:
    "not both associated with the same ground truth region"). Their regions are negatives of
    neither either: IoU 1 with the box."""
    objects = [
        {"phrase": "the stairs", "box": [0, 0, 10, 10], "entity": "21"},
        {"phrase": "the steps", "box": [0, 0, 10, 10], "entity": "22"},
        {**OBJECTS[1], "entity": "9"},
    ]
    rows = image(objects, negatives="all")
    assert rows["entity"].tolist() == [0, 1, 2]
    assert sorted(map(tuple, rows["phrase_negatives"].tolist())) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    assert listed_for(rows, 0) == listed_for(rows, 1) == OWN_NEGATIVES[0]


def test_objects_without_an_entity_are_chains_of_their_own():
    assert chains(
        [
            {"phrase": "a"},
            {"phrase": "b"},
            {"phrase": "c", "entity": "3"},
            {"phrase": "d", "entity": 3},
            {"phrase": "e"},
        ]
    ) == [0, 1, 2, 2, 3]


def test_every_positive_makes_a_pair_of_each_positive_proposal():
    """Algorithm 1 for the similarity network: every proposal of IoU >= 0.7 with the phrase's box
    is a positive pair of its own (object 0 has two: proposals 0 and 1; object 1 one: 3), each
    pair with its own draw of negatives among the phrase's."""
    features = np.arange(len(PROPOSALS), dtype=np.float32)[:, None].repeat(3, 1)
    rows = training_image({"objects": OBJECTS}, REGIONS, features, PROPOSALS, random.Random(0), True, 1, True)
    assert rows["phrases"] == ["a red circle", "a red circle", "a blue square"]
    assert rows["entity"].tolist() == [0, 0, 1]
    assert rows["positive"][:, 0].tolist() == [0.0, 1.0, 3.0]
    assert rows["positive_box"].tolist() == PROPOSALS[[0, 1, 3]].tolist()
    for entry, phrase in enumerate((0, 0, 1)):
        assert len(drawn_for(rows, entry)) == 1 and drawn_for(rows, entry) <= OWN_NEGATIVES[phrase]
    # one chain: the two copies of "a red circle" are not each other's negatives
    assert sorted(map(tuple, rows["phrase_negatives"].tolist())) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    # without augmentation it changes nothing: the box's own region, once
    plain = training_image({"objects": OBJECTS}, REGIONS, features, PROPOSALS, random.Random(0), False, 1, True)
    assert plain["positive"][:, 0].tolist() == [-2.0, -3.0]


def test_without_augmentation_the_positive_is_the_box_own_region():
    rows = image(augmented=False, negatives=10)
    assert rows["positive"][:, 0].tolist() == [-2.0, -3.0]
    assert rows["positive_box"].tolist() == [o["box"] for o in OBJECTS]
    assert [len(drawn_for(rows, i)) for i in (0, 1)] == [5, 7]  # all there are, when fewer than asked


def test_a_phrase_without_positive_or_region_is_left_out():
    far = [{"phrase": "a green star", "box": [60, 60, 70, 70]}]
    rows = image(OBJECTS[:1] + far, negatives=1)
    assert rows["phrases"] == ["a red circle"] and len(rows["positive"]) == 1
    assert rows["phrase_negatives"].shape == (0, 2)
    empty = image(far, negatives=1)
    assert empty["phrases"] == [] and empty["negatives"].shape == (0, 3) and empty["drawn"].shape == (0, 2)


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
        TwoBranchEmbedRecipe(config, None, 6).preflight(ShardSet.open(config.data.shards))
