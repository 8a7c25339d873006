"""The harder phrase variant of synth (`python -m vldist.shards synth --phrases hard`): phrases whose
shape and colour name several objects, relation phrases that name one, proposals around the
look-alikes, the schema and proposal count of the standard set; and the standard set unchanged
when the option is not given."""

from __future__ import annotations

import hashlib
import io
import json
import random
import re

import numpy as np
import pytest
from helpers import read_shard_set

from vldist.data.vocab import Vocab
from vldist.shards.__main__ import main
from vldist.shards.synthetic.hard_phrases import generate_hard_scene, make_hard_proposals

SMALL = ["--train", "8", "--val", "4", "--test", "4", "--shard-size", "5", "--feature-size", "32", "--quiet"]
# sha256 of every sample's key and JSON (splits in manifest order) and of vocab.json of
# `synth --out X` + SMALL, built at commit a99aab8, before the option existed. The JSON holds the
# captions, drawn from each split's stream after the scene is rendered, so the same JSON means the
# same images too (the JPEG and feature bytes themselves depend on the libraries and the CPU).
STANDARD_SMALL_SHA256 = "67666e0eb7bc4289fbff22bf34cced2cb853cb949c22b9c664b1a021b7b9c50d"

# The words of a relation phrase, written here from the captions' wordings, and the relation.
RELATION_OF = {
    "to the left of": "left",
    "left of": "left",
    "on the left of": "left",
    "to the right of": "right",
    "right of": "right",
    "on the right of": "right",
    "above": "above",
    "over": "above",
    "higher than": "above",
    "below": "below",
    "under": "below",
    "beneath": "below",
    "underneath": "below",
    "lower than": "below",
}
# colours near in hue and shapes near in outline, a pair of each in most scenes
NEAR_COLOURS = [{"red", "orange"}, {"red", "pink"}, {"pink", "purple"}, {"blue", "purple"}, {"orange", "yellow"}]
NEAR_SHAPES = [{"circle", "hexagon"}, {"square", "diamond"}, {"triangle", "star"}]
PHRASE = re.compile(r"^the (\w+) (\w+)(?: (.+) the (\w+) (\w+))?$")


def center(box):
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def holds(relation: str, a: list[int], b: list[int]) -> bool:
    """Box a is <relation> box b: apart along the relation's axis (a ends before b begins), and
    the centres' offset along it at least half the offset across it."""
    (ax, ay), (bx, by) = center(a), center(b)
    dx, dy = abs(bx - ax), abs(by - ay)
    if relation == "left":
        return a[2] <= b[0] and dx >= 0.5 * dy
    if relation == "right":
        return b[2] <= a[0] and dx >= 0.5 * dy
    if relation == "above":
        return a[3] <= b[1] and dy >= 0.5 * dx
    return b[3] <= a[1] and dy >= 0.5 * dx


def iou(a, b) -> float:
    w = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def resolve(phrase: str, objects: list[dict]) -> list[int]:
    """The objects (indices) a phrase names, read from its words alone: its shape and colour, and
    with relation words, those of its kind in that relation to the (one) landmark."""
    match = PHRASE.match(phrase)
    assert match, phrase
    color, shape, words, landmark_color, landmark_shape = match.groups()
    same = [i for i, o in enumerate(objects) if (o["color"], o["shape"]) == (color, shape)]
    if words is None:
        return same
    landmarks = [o for o in objects if (o["color"], o["shape"]) == (landmark_color, landmark_shape)]
    assert len(landmarks) == 1, f"{phrase!r}: the landmark is not alone of its kind"
    return [i for i in same if holds(RELATION_OF[words], objects[i]["box"], landmarks[0]["box"])]


def kind_count(objects: list[dict], obj: dict) -> int:
    return sum((o["color"], o["shape"]) == (obj["color"], obj["shape"]) for o in objects)


def scene_metas(n: int = 300, seed: int = 5) -> list[dict]:
    """`n` hard scenes and their proposals as the JSON would hold them."""
    rng = random.Random(seed)
    metas = []
    for i in range(n):
        scene = generate_hard_scene(rng, 128)
        objects = [
            {"box": list(o.box), "phrase": o.expression, "shape": o.shape, "color": o.color} for o in scene.objects
        ]
        boxes = make_hard_proposals(128, 128, [o["box"] for o in objects], 32, random.Random(i))
        metas.append({"objects": objects, "proposal_boxes": boxes})
    return metas


@pytest.fixture(scope="module")
def metas() -> list[dict]:
    return scene_metas()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    assert main(["synth", "--out", str(root / "hard"), "--phrases", "hard", *SMALL]) == 0
    assert main(["synth", "--out", str(root / "standard"), *SMALL]) == 0
    return root


# --- the standard set ---------------------------------------------------------------------------


def test_without_the_option_the_standard_set_is_as_it_was(built):
    out = built / "standard"
    digest = hashlib.sha256()
    for _split, samples in read_shard_set(out).items():
        for key, members in samples:
            digest.update(key.encode())
            digest.update(members["json"])
    digest.update((out / "vocab.json").read_bytes())
    assert digest.hexdigest() == STANDARD_SMALL_SHA256
    manifest = json.loads((out / "manifest.json").read_text())
    assert "phrases" not in manifest["config"] and manifest["features"]["max_regions"] == 5


# --- the hard set as built ----------------------------------------------------------------------


def test_the_hard_set_has_the_standard_schema_and_proposal_count(built):
    manifest = json.loads((built / "hard" / "manifest.json").read_text())
    assert manifest["source"] == "synth" and manifest["config"]["phrases"] == "hard"
    assert manifest["features"]["proposals"] == 32 and manifest["features"]["max_regions"] == 9
    vocab = Vocab.load(built / "hard" / "vocab.json")
    standard = json.loads(next(iter(read_shard_set(built / "standard")["val"]))[1]["json"])
    for split, samples in read_shard_set(built / "hard").items():
        assert len(samples) == {"train": 8, "val": 4, "test": 4}[split]
        for _key, members in samples:
            assert set(members) == {"jpg", "json", "regions.npy", "proposals.npy"}
            meta = json.loads(members["json"])
            assert set(meta) == set(standard)
            assert all(set(o) == set(standard["objects"][0]) for o in meta["objects"])
            regions = np.load(io.BytesIO(members["regions.npy"]))
            proposals = np.load(io.BytesIO(members["proposals.npy"]))
            assert regions.shape == (1 + len(meta["objects"]), 2048) and proposals.shape == (32, 2048)
            boxes = meta["proposal_boxes"]
            assert len({tuple(b) for b in boxes}) == 32
            assert all(0 <= x0 < x1 <= 128 and 0 <= y0 < y1 <= 128 for x0, y0, x1, y1 in boxes)
            for obj in meta["objects"]:
                assert meta["region_boxes"][obj["region"]] == obj["box"]
                assert resolve(obj["phrase"], meta["objects"]) == [meta["objects"].index(obj)]
                if split == "train":  # vocab.json covers the train phrases (a small set's test may say other words)
                    assert vocab.unk_id not in vocab.encode(obj["phrase"]), obj["phrase"]
                assert max(iou(obj["box"], b) for b in boxes) >= 0.7  # a positive for every phrase


def test_the_same_arguments_give_the_same_hard_scenes():
    one, two = generate_hard_scene(random.Random(11)), generate_hard_scene(random.Random(11))
    assert [o.expression for o in one.objects] == [o.expression for o in two.objects]
    assert one.objects == two.objects and one.image.tobytes() == two.image.tobytes()


# --- the properties that make it hard -------------------------------------------------------------


def test_shape_and_colour_alone_are_ambiguous_and_the_relation_words_resolve_them(metas):
    phrases = ambiguous = relational = 0
    for meta in metas:
        objects = meta["objects"]
        for index, obj in enumerate(objects):
            phrases += 1
            shape_colour = [
                i for i, o in enumerate(objects) if (o["color"], o["shape"]) == (obj["color"], obj["shape"])
            ]
            words = PHRASE.match(obj["phrase"]).group(3)
            if len(shape_colour) > 1:
                ambiguous += 1
                assert words is not None, f"{obj['phrase']!r} names {len(shape_colour)} objects"
            else:
                assert words is None, obj["phrase"]  # relation words only where they are needed
            if words is not None:
                relational += 1
            assert resolve(obj["phrase"], objects) == [index], obj["phrase"]
    assert ambiguous == relational and 0.35 <= ambiguous / phrases <= 0.7
    wordings = {PHRASE.match(o["phrase"]).group(3) for m in metas for o in m["objects"]} - {None}
    assert {RELATION_OF[w] for w in wordings} == {"left", "right", "above", "below"}


def test_crowded_overlapping_scenes_of_few_kinds(metas):
    counts = [len(m["objects"]) for m in metas]
    assert max(counts) == 8 and min(counts) >= 3 and np.mean([c >= 5 for c in counts]) >= 0.9
    overlapping = near_colours = near_shapes = 0
    for meta in metas:
        objects = meta["objects"]
        colours, shapes = {o["color"] for o in objects}, {o["shape"] for o in objects}
        assert len(colours) <= 3 and len(shapes) <= 3
        near_colours += any(pair <= colours for pair in NEAR_COLOURS)
        near_shapes += any(pair <= shapes for pair in NEAR_SHAPES)
        # every scene has a look-alike: another object of the same shape or of the same colour
        assert any(
            a is not b and (a["shape"] == b["shape"] or a["color"] == b["color"]) for a in objects for b in objects
        )
        pairs = [(a["box"], b["box"]) for i, a in enumerate(objects) for b in objects[i + 1 :]]
        for a, b in pairs:
            w = max(0, min(a[2], b[2]) - max(a[0], b[0]))
            h = max(0, min(a[3], b[3]) - max(a[1], b[1]))
            smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
            assert w * h <= 0.3 * smaller
        overlapping += any(iou(a, b) > 0 for a, b in pairs)
    assert overlapping / len(metas) >= 0.5
    assert near_colours / len(metas) >= 0.8 and near_shapes / len(metas) >= 0.8


def test_proposals_hold_tight_boxes_around_the_same_kind_distractors(metas):
    """For a phrase of a repeated kind, a look-alike of it has a proposal of IoU >= 0.7 with its
    own box that is a negative of the phrase (IoU < 0.3 with the phrase's box): ranked by
    appearance alone, it competes with the phrase's own positives."""
    distractors = with_tight_negative = 0
    for meta in metas:
        objects, boxes = meta["objects"], meta["proposal_boxes"]
        assert len(boxes) == 32
        for obj in objects:
            assert max(iou(obj["box"], b) for b in boxes) >= 0.7
            if kind_count(objects, obj) < 2:
                continue
            look_alikes = [
                o for o in objects if o is not obj and (o["shape"], o["color"]) == (obj["shape"], obj["color"])
            ]
            found = [any(iou(d["box"], b) >= 0.7 and iou(obj["box"], b) < 0.3 for b in boxes) for d in look_alikes]
            assert any(found), obj["phrase"]
            distractors += len(found)
            with_tight_negative += sum(found)
    assert with_tight_negative / distractors >= 0.95
