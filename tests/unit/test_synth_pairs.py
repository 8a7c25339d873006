"""The synthetic image pairs of L2C: true descriptions, one controlled change, masks, the built set.

Descriptions are checked against the objects of both scenes by a parser of their own below, not
with the generator's predicates, so a template that says something false fails here.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import read_shard_set
from PIL import Image

from vldist.data.vocab import Vocab, tokenize
from vldist.shards.__main__ import main
from vldist.shards.synthetic.captions import make_captions
from vldist.shards.synthetic.embedded_set import split_rng
from vldist.shards.synthetic.pairs import (
    CHANGE_KINDS,
    STREAM_NAME,
    build_synth_pairs,
    foreground_mask,
    make_pair,
    swap_image_tokens,
)
from vldist.shards.synthetic.scenes import COLORS, SHAPES, SceneObject, generate_scene

SIZE = 128
TINY = dict(n_train=12, n_val=4, n_test=4, shard_size=5, progress=False)
MEMBERS = {"json", "img1.jpg", "img2.jpg", "img1.mask.png", "img2.mask.png"}


def _pairs(seeds=(0, 1, 2), per_seed=120):
    return [p for seed in seeds for p in _stream(seed, per_seed)]


def _stream(seed, n):
    rng = random.Random(f"test-pairs:{seed}")
    return [make_pair(rng) for _ in range(n)]


# --- an independent reader of descriptions ----------------------------------------------------

C, S = "|".join(COLORS), "|".join(SHAPES)
OPENING = re.compile(r"^(?:the difference is that|one difference is that|the change is that) ")
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4}
PLACEHOLDERS = {
    "{X}": r"(?P<x>image[12])",
    "{Y}": r"(?P<y>image[12])",
    "{OBJ}": rf"(?:(?P<size>small|large) )?(?P<color>{C}) (?P<shape>{S})",
    "{NAME}": rf"(?P<color>{C}) (?P<shape>{S})",
    "{CMP}": r"(?P<cmp>larger|bigger|smaller)",
    "{DIR}": r"(?P<dir>(?:further|more) (?:to the )?(?:left|right)|higher(?: up)?|lower(?: down)?"
    r"|nearer the (?:top|bottom))",
    "{NOUN}": r"(?:shape|object|figure)s?",
    "{N1}": r"(?P<n1>one|two|three|four)",
    "{N2}": r"(?P<n2>one|two|three|four)",
}
ZONE = (
    r"(?:at|in|on|near) the (?:top left|top right|bottom left|bottom right|top|bottom|left|right|middle|center)"
    r"(?: corner| edge)?"
)


def _find(objs, color, shape):
    found = [o for o in objs if (o.color, o.shape) == (color, shape)]
    assert len(found) <= 1, f"two {color} {shape}s in one image"
    return found[0] if found else None


def _area(obj):
    x0, y0, x1, y1 = obj.box
    return (x1 - x0) * (y1 - y0)


def _centre(obj):
    x0, y0, x1, y1 = obj.box
    return (x0 + x1) / 2, (y0 + y1) / 2


def _present(im, image, m):
    obj = _find(im[image], m["color"], m["shape"])
    assert obj is not None, f"no {m['color']} {m['shape']} in {image}"
    if m.groupdict().get("size"):
        assert obj.size == m["size"], f"the {m['color']} {m['shape']} of {image} is not {m['size']}"
    return obj


def _absent(im, image, m):
    assert _find(im[image], m["color"], m["shape"]) is None, f"{image} does have a {m['color']} {m['shape']}"


def _recoloured(m, im, w):
    """x's c1 shape stands where y's c2 shape stands, and neither image has the other's."""
    x, y, s = m["x"], m["y"], m["s"]
    a, b = _find(im[x], m["c1"], s), _find(im[y], m["c2"], s)
    assert a and b and a.box == b.box and m["c1"] != m["c2"]
    assert _find(im[y], m["c1"], s) is None and _find(im[x], m["c2"], s) is None
    if m.groupdict().get("size"):
        assert a.size == m["size"]


def _unique_shape(m, im, w):
    for image in ("image1", "image2"):
        assert sum(o.shape == m["s"] for o in im[image]) == 1, f"'the {m['s']}' is ambiguous in {image}"


def _recoloured_unique(m, im, w):
    _unique_shape(m, im, w)
    _recoloured(m, im, w)


def _colour_differs(m, im, w):
    _unique_shape(m, im, w)
    a, b = ([o for o in im[image] if o.shape == m["s"]][0] for image in (m["x"], m["y"]))
    assert a.box == b.box and a.color != b.color


def _compared(m, im, w):
    a, b = _present(im, m["x"], m), _present(im, m["y"], m)
    larger, smaller = (a, b) if m["cmp"] in ("larger", "bigger") else (b, a)
    assert (larger.size, smaller.size) == ("large", "small") and _area(larger) > 2 * _area(smaller)


def _sizes(m, im, w):
    a, b = _present(im, m["x"], m), _present(im, m["y"], m)
    assert (a.size, b.size) == (m["s1"], m["s2"])
    assert (_area(a) > _area(b)) == (a.size == "large")


def _moved(m, im, w):
    a, b = _present(im, m["x"], m), _present(im, m["y"], m)
    assert math.dist(_centre(a), _centre(b)) >= 0.25 * w - 1


def _other(image):
    return "image2" if image == "image1" else "image1"


def _direction(m, im, w):
    """x's object lies clearly (a tenth of the side) in that direction from y's."""
    y = m.groupdict().get("y") or _other(m["x"])
    (ax, ay), (bx, by) = _centre(_present(im, m["x"], m)), _centre(_present(im, y, m))
    words = m["dir"]
    if "left" in words:
        assert ax < bx - 0.1 * w
    elif "right" in words:
        assert ax > bx + 0.1 * w
    elif "higher" in words or "top" in words:
        assert ay < by - 0.1 * w
    else:
        assert ay > by + 0.1 * w


def _moves(m, im, w):
    (ax, ay), (bx, by) = _centre(_present(im, m["x"], m)), _centre(_present(im, m["y"], m))
    delta = {"left": ax - bx, "right": bx - ax, "up": ay - by, "down": by - ay}[m["move"]]
    assert delta > 0.1 * w


def _in_zone(phrase, obj, w):
    cx, cy = _centre(obj)
    words = set(phrase.split())
    vertical = "top" if "top" in words else "bottom" if "bottom" in words else "middle"
    horizontal = "left" if "left" in words else "right" if "right" in words else "center"
    thirds = {
        "top": cy < w / 3,
        "bottom": cy > 2 * w / 3,
        "middle": w / 3 <= cy <= 2 * w / 3,
        "left": cx < w / 3,
        "right": cx > 2 * w / 3,
        "center": w / 3 <= cx <= 2 * w / 3,
    }
    assert thirds[vertical] and thirds[horizontal], f"{obj} is not {phrase}"


def _zones(m, im, w):
    _in_zone(m["z1"], _present(im, m["x"], m), w)
    _in_zone(m["z2"], _present(im, m["y"], m), w)


def _only_in(m, im, w):
    y = m.groupdict().get("y") or _other(m["x"])
    _present(im, m["x"], m)
    _absent(im, y, m)


def _counts(m, im, w):
    assert (len(im[m["x"]]), len(im[m["y"]])) == (NUMBERS[m["n1"]], NUMBERS[m["n2"]])


def _one_more(m, im, w):
    assert len(im[m["x"]]) == len(im[m["y"]]) + 1


def _more_or_fewer(m, im, w):
    nx, ny = len(im[m["x"]]), len(im[m["y"]])
    assert nx > ny if m["more"] == "more" else nx < ny


def _in_both(m, im, w):
    _present(im, "image1", m)
    _present(im, "image2", m)


def _same(m, im, w):
    a, b = _present(im, "image1", m), _present(im, "image2", m)
    assert (a.box, a.size) == (b.box, b.size)


def _both_count(m, im, w):
    assert len(im["image1"]) == len(im["image2"]) == NUMBERS[m["n1"]]


CLAIMS = [
    (template, check)
    for template, check in [
        # colour
        ("{X} shows an? (?P<c1>C) (?P<s>S) where {Y} shows an? (?P<c2>C) (?P=s)", _recoloured),
        ("{X} has an? (?P<c1>C) (?P<s>S) but {Y} has an? (?P<c2>C) one", _recoloured),
        ("{X} has an? (?P<c1>C) (?P<s>S) instead of the (?P<c2>C) (?P=s) in {Y}", _recoloured),
        ("the (?:(?P<size>small|large) )?(?P<c1>C) (?P<s>S) (?:of|in) {X} is (?P<c2>C) in {Y}", _recoloured),
        ("the (?P<s>S) is (?P<c1>C) in {X} and (?P<c2>C) in {Y}", _recoloured_unique),
        ("the (?P<s>S) has a different colour in {X} and {Y}", _colour_differs),
        # size
        ("{X} has a {CMP} {NAME} than {Y}", _compared),
        ("the {NAME} is {CMP} in {X} than in {Y}", _compared),
        ("the {NAME} in {X} is {CMP} than the one in {Y}", _compared),
        ("{X} shows the {NAME} {CMP} than {Y} does", _compared),
        ("the {NAME} is (?P<s1>small|large) in {X} (?:and|but) (?P<s2>small|large) in {Y}", _sizes),
        ("{X} has a (?P<s1>small|large) {NAME} where {Y} has a (?P<s2>small|large) one", _sizes),
        # position
        ("the {NAME} is in a different place in {X} and {Y}", _moved),
        ("{X} and {Y} show the {NAME} in different places", _moved),
        ("the {NAME} is {DIR} in {X}(?: than in {Y})?", _direction),
        ("in {X} the {NAME} is {DIR} than in {Y}", _direction),
        ("the {NAME} moves (?P<move>left|right|up|down) from {X} to {Y}", _moves),
        (f"the {{NAME}} is (?P<z1>{ZONE}) in {{X}} and (?P<z2>{ZONE}) in {{Y}}", _zones),
        # one object more or fewer
        ("{X} has an? {OBJ} that {Y} does not have", _only_in),
        ("there is an? {OBJ} in {X} but not in {Y}", _only_in),
        ("the {OBJ} of {X} is missing from {Y}", _only_in),
        ("{Y} does not have the {OBJ} that {X} has", _only_in),
        ("only {X} contains an? {OBJ}", _only_in),
        ("{Y} lacks the {OBJ} of {X}", _only_in),
        ("{X} has {N1} {NOUN} and {Y} has {N2}", _counts),
        ("{X} has one more {NOUN} than {Y}", _one_more),
        ("{Y} has one {NOUN} fewer than {X}", _one_more),
        ("{X} has (?P<more>more|fewer) {NOUN} than {Y}", _more_or_fewer),
        # what both share
        ("both images (?:have|show) an? {OBJ}", _in_both),
        ("{X} and {Y} both have an? {OBJ}", _in_both),
        ("there is an? {OBJ} in both images", _in_both),
        ("the {NAME} is the same in both images", _same),
        ("both images have {N1} {NOUN}", _both_count),
    ]
]


def _compile(template: str) -> re.Pattern:
    for name, regex in PLACEHOLDERS.items():
        template = template.replace(name, regex)
    return re.compile(
        template.replace("(?P<c1>C)", f"(?P<c1>{C})")
        .replace("(?P<c2>C)", f"(?P<c2>{C})")
        .replace("(?P<s>S)", f"(?P<s>{S})")
    )


COMPILED = [(_compile(t), check) for t, check in CLAIMS]


def check_description(text: str, first, second, width: int = SIZE) -> str:
    """Asserts that `text` is true of the pair; returns the claim it makes (its template)."""
    assert re.fullmatch(r"[a-z0-9 ]+", text) and len(tokenize(text)) <= 18, f"form: {text!r}"
    assert not re.search(r"\ba [aeiou]|\ban [^aeiou]", text), f"article: {text!r}"
    core = OPENING.sub("", text)
    images = {"image1": first.objects, "image2": second.objects}
    matched = [(pattern, check, pattern.fullmatch(core)) for pattern, check in COMPILED]
    matched = [(pattern, check, m) for pattern, check, m in matched if m]
    assert matched, f"no checker reads {text!r}"
    for _, check, m in matched:
        groups = m.groupdict()
        if "x" in groups and "y" in groups and groups["y"]:
            assert groups["x"] != groups["y"], f"compares an image with itself: {text!r}"
        try:
            check(m, images, width)
        except AssertionError as err:
            raise AssertionError(f"false: {text!r} ({err})") from None
    return matched[0][0].pattern


# --- descriptions and changes ---------------------------------------------------------------


def _check_scene(objects, width=SIZE):
    assert 1 <= len(objects) <= 4
    assert len({(o.shape, o.color) for o in objects}) == len(objects)
    for i, a in enumerate(objects):
        assert 0 <= a.box[0] < a.box[2] <= width and 0 <= a.box[1] < a.box[3] <= width
        for b in objects[i + 1 :]:  # at least GAP (3) free pixels between boxes
            assert (
                a.box[2] + 3 <= b.box[0]
                or b.box[2] + 3 <= a.box[0]
                or a.box[3] + 3 <= b.box[1]
                or b.box[3] + 3 <= a.box[1]
            )


def _check_one_change(pair):
    """The scenes differ in exactly what `change` says, read from the objects themselves."""
    one = {(o.color, o.shape): o for o in pair.first.objects}
    two = {(o.color, o.shape): o for o in pair.second.objects}
    change = pair.change
    kind = change["kind"]
    same = [k for k in one if k in two and (one[k].box, one[k].size) == (two[k].box, two[k].size)]
    if kind == "count":
        assert abs(len(one) - len(two)) == 1 and len(same) == min(len(one), len(two))
        only = (set(one) ^ set(two)).pop()
        assert only == (change["color"], change["shape"])
        assert change["only_in"] == ("image1" if only in one else "image2")
        assert (change["image1"], change["image2"]) == (len(one), len(two))
        return
    assert len(one) == len(two) and len(same) == len(one) - 1
    if kind == "color":
        (a,), (b,) = [one[k] for k in one if k not in two], [two[k] for k in two if k not in one]
        assert a.shape == b.shape == change["shape"] and a.box == b.box and a.size == b.size
        assert (a.color, b.color) == (change["image1"], change["image2"])
        return
    assert set(one) == set(two)
    (key,) = [k for k in one if k not in same]
    a, b = one[key], two[key]
    assert key == (change["color"], change["shape"])
    if kind == "size":
        assert a.size != b.size and (a.size, b.size) == (change["image1"], change["image2"])
    else:
        assert kind == "position" and a.size == b.size
        assert (a.box[2] - a.box[0], a.box[3] - a.box[1]) == (b.box[2] - b.box[0], b.box[3] - b.box[1])
        assert math.dist(_centre(a), _centre(b)) >= SIZE / 4 - 1
        assert [change["image1"], change["image2"]] == [list(_centre(a)), list(_centre(b))]


def test_every_description_is_true_and_each_pair_has_one_change():
    claims, kinds, subjects, larger_in = Counter(), Counter(), Counter(), Counter()
    for pair in _pairs():
        _check_scene(pair.first.objects)
        _check_scene(pair.second.objects)
        _check_one_change(pair)
        kinds[pair.change["kind"]] += 1
        if pair.change["kind"] == "size":
            larger_in["image1" if pair.change["image1"] == "large" else "image2"] += 1
        assert len(pair.descriptions) == 5 == len(set(pair.descriptions))
        assert len({OPENING.sub("", d) for d in pair.descriptions}) == 5  # not one sentence with two openings
        json.dumps(pair.change)
        for text in pair.descriptions:
            claims[check_description(text, pair.first, pair.second)] += 1
            subjects[OPENING.sub("", text).split()[0]] += 1
    assert set(kinds) == set(CHANGE_KINDS) and min(kinds.values()) > 40
    assert larger_in["image1"] > 10 and larger_in["image2"] > 10
    assert subjects["image1"] > 50 and subjects["image2"] > 50  # both orders of speaking
    assert len(claims) == len(CLAIMS), f"never seen: { ({p.pattern for p, _ in COMPILED} - set(claims)) }"


def test_checker_catches_false_descriptions():
    def obj(shape, color, size, box):
        return SceneObject(shape, color, size, box)

    one = SimpleNamespace(
        objects=[obj("circle", "red", "small", [10, 10, 30, 30]), obj("square", "blue", "large", [60, 60, 100, 100])]
    )
    two = SimpleNamespace(
        objects=[obj("circle", "red", "large", [10, 10, 50, 50]), obj("square", "blue", "large", [60, 60, 100, 100])]
    )
    for true in (
        "image2 has a larger red circle than image1",
        "both images have a large blue square",
        "the red circle is small in image1 and large in image2",
        "both images have two shapes",
        "the difference is that the red circle in image1 is smaller than the one in image2",
    ):
        check_description(true, one, two)
    for false in (
        "image1 has a larger red circle than image2",
        "both images have a green square",
        "both images have a small blue square",
        "image1 has a blue star that image2 does not have",
        "the red circle is further left in image1",
        "image1 has three shapes and image2 has two",
        "the red circle is the same in both images",
        "image1 shows a red circle where image2 shows a blue circle",
        "the circle is red in image1 and yellow in image2",
        "the red circle moves down from image1 to image2",
        "image1 has a red circle that image1 does not have",
        "a red circle somewhere",
        "image1 has a larger red circle than image2.",
    ):
        with pytest.raises(AssertionError):
            check_description(false, one, two)


def test_pairs_are_deterministic_and_varied():
    assert make_pair(random.Random(4)).descriptions == make_pair(random.Random(4)).descriptions
    a, b = make_pair(random.Random(4)), make_pair(random.Random(4))
    assert a.first.image.tobytes() == b.first.image.tobytes() and a.change == b.change
    words = {w for p in _stream(9, 100) for d in p.descriptions for w in tokenize(d)}
    assert len(words) > 60


# --- masks ------------------------------------------------------------------------------------


def test_mask_covers_exactly_the_drawn_objects():
    rng = random.Random(12)
    scenes = [generate_scene(rng) for _ in range(40)] + [s for p in _stream(3, 20) for s in (p.first, p.second)]
    ratios = {}
    for scene in scenes:
        mask = foreground_mask(scene)
        assert mask.dtype == np.uint8 and mask.shape == (scene.height, scene.width) and set(np.unique(mask)) <= {0, 1}
        # the background is light (>= 219 in every channel); every colour has a channel far below it
        drawn = np.asarray(scene.image).min(axis=2) < 200
        assert np.array_equal(mask.astype(bool), drawn)
        inside = np.zeros_like(mask, dtype=bool)
        for obj in scene.objects:
            x0, y0, x1, y1 = obj.box
            inside[y0:y1, x0:x1] = True
            ratios.setdefault(obj.shape, []).append(mask[y0:y1, x0:x1].mean())
        assert not mask[~inside].any()
    assert abs(np.mean(ratios["circle"]) - math.pi / 4) < 0.05
    assert np.mean(ratios["square"]) > 0.9
    assert all(min(r) > 0.25 for r in ratios.values())


# --- flipping a pair --------------------------------------------------------------------------


def test_swap_image_tokens():
    assert (
        swap_image_tokens("image1 has a larger red circle than image2") == "image2 has a larger red circle than image1"
    )
    assert (
        swap_image_tokens("animal1 has a longer beak than animal2, animal2's wings")
        == "animal2 has a longer beak than animal1, animal1's wings"
    )
    assert swap_image_tokens("Animal1 is darker") == "Animal2 is darker"
    for untouched in ("image10 and image1s", "myimage1 animal12", "image 1", "image_1"):
        assert swap_image_tokens(untouched) == untouched
    for pair in _stream(5, 20):
        for text in pair.descriptions:  # a flipped pair's descriptions are true of the flipped pair
            check_description(swap_image_tokens(text), pair.second, pair.first)
            assert swap_image_tokens(swap_image_tokens(text)) == text


# --- the built set ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return root, build_synth_pairs(root / "a", **TINY)


def _samples(out, split):
    """Samples of a split as {key: {ext: bytes}}, read with plain tarfile."""
    return dict(read_shard_set(out)[split])


def test_built_set_round_trips(tiny):
    root, manifest = tiny
    out = root / "a"
    assert not (root / "a.partial").exists()
    assert {p.name for p in out.glob("*.idx.json")} == {f"{p.name}.idx.json" for p in out.glob("*.tar")}
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".idx.json")) == [
        "manifest.json",
        "test-000000.tar",
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
        "val-000000.tar",
        "vocab.json",
    ]
    assert manifest["source"] == "synth-pairs"
    assert manifest["pairs"] == {"masks": True, "image_tokens": ["image1", "image2"]}
    assert manifest["config"] == {"n_train": 12, "n_val": 4, "n_test": 4, "seed": 0, "shard_size": 5, "image_size": 128}
    assert [s["samples"] for s in manifest["splits"]["train"]["shards"]] == [5, 5, 2]
    for split in ("train", "val", "test"):
        samples = _samples(out, split)
        assert sorted(samples) == [f"{split}-{i:07d}" for i in range(TINY[f"n_{split}"])]
        rng = split_rng(STREAM_NAME, 0, split)
        for key in sorted(samples):
            members, pair = samples[key], make_pair(rng)  # the same stream regenerates the pair
            assert set(members) == MEMBERS
            meta = json.loads(members["json"])
            assert (meta["id"], meta["split"]) == (key, split)
            assert meta["captions"] == pair.descriptions and meta["change"] == pair.change
            for name, scene in (("img1", pair.first), ("img2", pair.second)):
                assert meta[name]["width"] == meta[name]["height"] == 128
                assert meta[name]["objects"] == [
                    {"box": o.box, "phrase": o.phrase, "shape": o.shape, "color": o.color, "size": o.size}
                    for o in scene.objects
                ]
                image = Image.open(io.BytesIO(members[f"{name}.jpg"]))
                assert image.format == "JPEG" and image.mode == "RGB" and image.size == (128, 128)
                mask = Image.open(io.BytesIO(members[f"{name}.mask.png"]))
                assert mask.format == "PNG" and mask.mode == "L"
                pixels = np.asarray(mask)
                assert set(np.unique(pixels)) <= {0, 255}
                assert np.array_equal(pixels, foreground_mask(scene) * 255)
            for text in meta["captions"]:
                check_description(
                    text, SimpleNamespace(objects=pair.first.objects), SimpleNamespace(objects=pair.second.objects)
                )


def test_vocab_covers_descriptions_and_single_captions(tiny):
    root, _ = tiny
    vocab = Vocab.load(root / "a" / "vocab.json")
    described = set()
    for members in _samples(root / "a", "train").values():
        for text in json.loads(members["json"])["captions"]:
            assert vocab.unk_id not in vocab.encode(text), text
            described.update(tokenize(text))
    assert {"image1", "image2"} <= set(vocab.itos)
    # words only single-image captions use: the vocabulary serves L2C's single-image stream too
    rng = random.Random(0)
    caption_words = {w for _ in range(300) for c in make_captions(generate_scene(rng), rng) for w in tokenize(c)}
    only_captions = set(vocab.itos[4:]) - described
    assert len(only_captions) >= 5 and only_captions <= caption_words


def test_rebuild_is_byte_identical(tiny):
    root, manifest = tiny
    assert build_synth_pairs(root / "b", **TINY) == manifest
    for shard in manifest["splits"]["train"]["shards"]:
        assert (root / "a" / shard["file"]).read_bytes() == (root / "b" / shard["file"]).read_bytes()
    assert (root / "a" / "vocab.json").read_bytes() == (root / "b" / "vocab.json").read_bytes()
    other = build_synth_pairs(root / "c", **{**TINY, "seed": 1})
    assert other["splits"]["val"] != manifest["splits"]["val"]


def test_existing_set_is_not_overwritten_without_asking(tiny):
    root, manifest = tiny
    out = root / "e"
    build_synth_pairs(out, **{**TINY, "n_train": 2, "n_val": 1, "n_test": 1})
    with pytest.raises(FileExistsError, match="overwrite"):
        build_synth_pairs(out, **TINY)
    (root / "e.partial").mkdir()  # leftover of an interrupted build: removed, not an obstacle
    (root / "e.partial" / "train-000000.tar.tmp").write_bytes(b"half")
    assert build_synth_pairs(out, **TINY, overwrite=True) == manifest
    assert not (root / "e.partial").exists()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not part of a shard set"):
        build_synth_pairs(out, **TINY, overwrite=True)
    assert (out / "notes.txt").exists()
    with pytest.raises(ValueError, match="n_train"):
        build_synth_pairs(root / "f", **{**TINY, "n_train": 0})


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["synth-pairs", "--out", str(out), "--train", "3", "--val", "1", "--test", "1", "--quiet"]
    assert main(argv) == 0
    assert "train 3" in capsys.readouterr().out
    assert main(argv) == 2  # exists: refused with a message, not a traceback
    assert "--overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
