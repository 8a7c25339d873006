"""The synthetic dataset: scenes, true captions, region features and the built shard set."""

from __future__ import annotations

import io
import json
import random
import re

import numpy as np
import pytest
from helpers import read_shard_set
from PIL import Image

from vldist.data.vocab import Vocab, tokenize
from vldist.shards.__main__ import main
from vldist.shards.features.extractor import RegionFeatureExtractor
from vldist.shards.synthetic.captions import POSITION_WORDS, make_captions
from vldist.shards.synthetic.scenes import COLORS, SHAPES, SceneObject, generate_scene, render
from vldist.shards.synthetic.synth import build_synth

TINY = dict(n_train=8, n_val=4, n_test=4, shard_size=5, feature_size=32, progress=False)


# --- a built tiny set, shared by the tests below ---------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return root, build_synth(root / "a", **TINY)


def _samples(out, split):
    """Samples of a split as {key: {ext: bytes}}, read with plain tarfile."""
    return dict(read_shard_set(out)[split])


def test_layout_and_manifest(tiny):
    root, manifest = tiny
    out = root / "a"
    assert not (root / "a.partial").exists()
    names = sorted(p.name for p in out.iterdir() if not p.name.endswith(".idx.json"))
    assert {p.name for p in out.glob("*.idx.json")} == {f"{n}.idx.json" for n in names if n.endswith(".tar")}
    assert names == [
        "feature_standardization.safetensors",
        "manifest.json",
        "test-000000.tar",
        "train-000000.tar",
        "train-000001.tar",
        "val-000000.tar",
        "vocab.json",
    ]
    assert manifest["source"] == "synth" and manifest["version"] == 1
    assert {k: v["samples"] for k, v in manifest["splits"].items()} == {"train": 8, "val": 4, "test": 4}
    assert [s["samples"] for s in manifest["splits"]["train"]["shards"]] == [5, 3]
    features = manifest["features"]
    assert (features["extractor"], features["dim"], features["max_regions"], features["input_size"]) == (
        "resnet50",
        2048,
        5,
        32,
    )
    assert manifest["config"]["n_train"] == 8 and manifest["config"]["seed"] == 0


def test_samples_follow_the_schema(tiny):
    root, _ = tiny
    for split in ("train", "val", "test"):
        samples = _samples(root / "a", split)
        assert sorted(samples) == [f"{split}-{i:07d}" for i in range(len(samples))]
        for key, members in samples.items():
            assert set(members) == {"jpg", "json", "regions.npy", "proposals.npy"}
            meta = json.loads(members["json"])
            assert meta["id"] == key and meta["split"] == split
            w, h = meta["width"], meta["height"]
            image = Image.open(io.BytesIO(members["jpg"]))
            assert image.mode == "RGB" and image.size == (w, h) == (128, 128)
            assert len(meta["captions"]) == 5 == len(set(meta["captions"]))
            assert 1 <= len(meta["objects"]) <= 4
            for obj in meta["objects"]:
                x0, y0, x1, y1 = obj["box"]
                assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
                assert obj["phrase"] == f"a {obj['size']} {obj['color']} {obj['shape']}"
            boxes = meta["region_boxes"]
            assert boxes[0] == [0, 0, w, h]
            areas = [(b[2] - b[0]) * (b[3] - b[1]) for b in boxes[1:]]
            assert areas == sorted(areas, reverse=True)
            assert sorted(boxes[1:]) == sorted(o["box"] for o in meta["objects"])
            regions = np.load(io.BytesIO(members["regions.npy"]))
            assert regions.dtype == np.float16 and regions.shape == (len(boxes), 2048)
            assert np.isfinite(regions).all() and np.abs(regions).max() > 0
            _check_proposals(meta, regions, np.load(io.BytesIO(members["proposals.npy"])))


def _check_proposals(meta, regions, proposals):
    """Proposal boxes: distinct, inside the image, PROPOSALS of them, rows aligned with features
    extracted like the regions', and for each object at least one positive (IoU >= 0.7) and
    negatives (IoU < 0.3 to every object) to train with."""
    from vldist.data.phrases import overlaps
    from vldist.shards.synthetic.synth import PROPOSALS

    boxes = meta["proposal_boxes"]
    w, h = meta["width"], meta["height"]
    assert len(boxes) == PROPOSALS == len({tuple(b) for b in boxes}) == proposals.shape[0]
    assert all(0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h for x0, y0, x1, y1 in boxes)
    assert proposals.dtype == np.float16 and proposals.shape[1] == regions.shape[1]
    for obj in meta["objects"]:
        assert meta["region_boxes"][obj["region"]] == obj["box"]  # "region" names the object's row
        if obj["box"] in boxes:  # the same box: the same features, whichever member holds them
            assert np.array_equal(proposals[boxes.index(obj["box"])], regions[obj["region"]])
    iou = overlaps([o["box"] for o in meta["objects"]], np.array(boxes))
    assert (iou.max(1) >= 0.7).all()
    assert (iou.max(0) < 0.3).sum() >= 5


def test_vocab_covers_train_captions(tiny):
    root, _ = tiny
    vocab = Vocab.load(root / "a" / "vocab.json")
    for members in _samples(root / "a", "train").values():
        for caption in json.loads(members["json"])["captions"]:
            assert vocab.unk_id not in vocab.encode(caption), caption


def test_rebuild_is_byte_identical_and_splits_are_independent(tiny):
    root, manifest = tiny
    again = build_synth(root / "b", **TINY)
    assert again == manifest  # sha256 of every shard, so images, json and features alike
    for name in ("train-000000.tar", "val-000000.tar"):
        assert (root / "a" / name).read_bytes() == (root / "b" / name).read_bytes()
    # fewer train images: val and test do not change (each split has its own random stream)
    fewer = build_synth(root / "c", **{**TINY, "n_train": 3})
    for split in ("val", "test"):
        assert fewer["splits"][split] == manifest["splits"][split]
    assert fewer["splits"]["train"]["shards"][0]["sha256"] != manifest["splits"]["train"]["shards"][0]["sha256"]
    other_seed = build_synth(root / "d", **{**TINY, "seed": 1})
    assert other_seed["splits"]["val"] != manifest["splits"]["val"]


def test_proposals_leave_images_captions_and_regions_as_they_were(tiny):
    root, _ = tiny
    without = build_synth(root / "no-proposals", **{**TINY, "proposals": 0})
    assert not without["features"]["proposals"]
    for key, members in _samples(root / "no-proposals", "val").items():
        theirs = _samples(root / "a", "val")[key]
        assert set(members) == {"jpg", "json", "regions.npy"}
        assert members["jpg"] == theirs["jpg"] and members["regions.npy"] == theirs["regions.npy"]
        meta = json.loads(theirs["json"])
        del meta["proposal_boxes"]
        assert json.loads(members["json"]) == meta


def test_existing_set_is_not_overwritten_without_asking(tiny):
    root, manifest = tiny
    out = root / "e"
    build_synth(out, **{**TINY, "n_train": 2, "n_val": 1, "n_test": 1})
    with pytest.raises(FileExistsError, match="overwrite"):
        build_synth(out, **TINY)
    (root / "e.partial").mkdir()  # leftover of an interrupted build: removed, not an obstacle
    (root / "e.partial" / "train-000000.tar.tmp").write_bytes(b"half")
    replaced = build_synth(out, **TINY, overwrite=True)
    assert replaced == manifest and not (root / "e.partial").exists()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not part of a shard set"):
        build_synth(out, **TINY, overwrite=True)
    assert (out / "notes.txt").exists() and (out / "manifest.json").exists()


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["synth", "--out", str(out), "--train", "2", "--val", "1", "--test", "1", "--feature-size", "32", "--quiet"]
    assert main(argv) == 0
    assert "train 2" in capsys.readouterr().out
    assert main(argv) == 2  # exists: refused with a message, not a traceback
    assert "--overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
    with pytest.raises(SystemExit):
        main([])


# --- scenes --------------------------------------------------------------------------------


def test_scenes_are_valid_and_reproducible():
    rng = random.Random(3)
    counts = set()
    for _ in range(300):
        scene = generate_scene(rng, 128)
        objs = scene.objects
        counts.add(len(objs))
        assert len({(o.shape, o.color) for o in objs}) == len(objs)
        for i, a in enumerate(objs):
            assert 0 <= a.box[0] < a.box[2] <= 128 and 0 <= a.box[1] < a.box[3] <= 128
            for b in objs[i + 1 :]:  # boxes do not overlap
                assert a.box[2] <= b.box[0] or b.box[2] <= a.box[0] or a.box[3] <= b.box[1] or b.box[3] <= a.box[1]
    assert counts == {1, 2, 3, 4}
    one = generate_scene(random.Random(7))
    two = generate_scene(random.Random(7))
    assert one.objects == two.objects and one.image.tobytes() == two.image.tobytes()
    via_numpy = generate_scene(np.random.default_rng(7))
    assert via_numpy.objects == generate_scene(np.random.default_rng(7)).objects


def test_objects_are_drawn_in_their_colour_inside_their_box():
    scene = generate_scene(random.Random(11))
    pixels = np.asarray(scene.image).astype(int)
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2  # every shape covers its box centre
        assert np.abs(pixels[cy, cx] - COLORS[obj.color]).max() <= 1


# --- captions are true of their scene ------------------------------------------------------

MENTION = re.compile(rf"\b(?:(small|large) )?({'|'.join(COLORS)}) ({'|'.join(SHAPES)})\b")
RELATIONS = {
    "left": ("to the left of", "left of", "on the left of"),
    "right": ("to the right of", "right of", "on the right of"),
    "above": ("above", "over", "higher than"),
    "below": ("below", "under", "beneath", "underneath", "lower than"),
    "beside": ("next to", "beside"),
    "larger": ("larger than", "bigger than"),
    "smaller": ("smaller than",),
}
RELATION_OF = {phrase: kind for kind, phrases in RELATIONS.items() for phrase in phrases}
POSITION_PHRASES = sorted({p for ps in POSITION_WORDS.values() for p in ps}, key=len, reverse=True)
COUNTS = re.compile(r"\b(one|two|three|four) (?:shapes?|objects?|figures?)\b")


def _relation_holds(kind, a: SceneObject, b: SceneObject) -> bool:
    x_apart = a.box[2] <= b.box[0] or b.box[2] <= a.box[0]
    return {
        "left": a.box[2] <= b.box[0],
        "right": b.box[2] <= a.box[0],
        "above": a.box[3] <= b.box[1],
        "below": b.box[3] <= a.box[1],
        "beside": x_apart,
        "larger": (a.size, b.size) == ("large", "small"),
        "smaller": (a.size, b.size) == ("small", "large"),
    }[kind]


def _position_holds(phrase: str, obj: SceneObject, size: int) -> bool:
    cx, cy = obj.center
    words = set(phrase.split())
    vertical = "top" if words & {"top", "upper"} else "bottom" if words & {"bottom", "lower"} else "middle"
    horizontal = "left" if "left" in words else "right" if "right" in words else "center"
    v_ok = {"top": cy < size / 3, "bottom": cy > 2 * size / 3, "middle": size / 3 <= cy <= 2 * size / 3}
    h_ok = {"left": cx < size / 3, "right": cx > 2 * size / 3, "center": size / 3 <= cx <= 2 * size / 3}
    return v_ok[vertical] and h_ok[horizontal]


def check_caption(caption: str, scene) -> None:
    """Every object named exists (with its size, if said); every relation, position and count
    said holds. Fails on a relation word it cannot attribute, so new templates get checked too."""
    by_name = {(o.color, o.shape): o for o in scene.objects}
    mentions = list(MENTION.finditer(caption))
    assert mentions, f"names no object: {caption!r}"
    objs = []
    for m in mentions:
        obj = by_name.get((m.group(2), m.group(3)))
        assert obj is not None, f"{m.group(0)!r} is not in the scene: {caption!r}"
        assert m.group(1) in (None, obj.size), f"wrong size in {caption!r}"
        objs.append(obj)
    for i, m in enumerate(mentions):
        end = mentions[i + 1].start() if i + 1 < len(mentions) else len(caption)
        between = re.sub(r"\b(?:a|an)$", "", caption[m.end() : end].strip()).strip()
        relation = re.fullmatch(r"(?:is )?(.*)", between).group(1)
        if i + 1 < len(mentions) and relation in RELATION_OF:
            assert _relation_holds(RELATION_OF[relation], objs[i], objs[i + 1]), caption
            continue
        for phrase in POSITION_PHRASES:
            if between.startswith(phrase):
                assert _position_holds(phrase, objs[i], scene.width), caption
                between = between[len(phrase) :]
                break
        assert not any(re.search(rf"\b{p}\b", between) for p in RELATION_OF), f"unchecked relation in {caption!r}"
    for number in COUNTS.findall(caption.replace("one of them", "")):
        assert ["one", "two", "three", "four"].index(number) + 1 == len(scene.objects), caption
    if "single" in caption or "nothing else" in caption:
        assert len(scene.objects) == 1, caption


def test_captions_are_true_distinct_and_identify_the_scene():
    rng = random.Random(5)
    relation_captions = 0
    for _ in range(400):
        scene = generate_scene(rng)
        captions = make_captions(scene, rng)
        assert len(captions) == 5 == len(set(captions))
        for caption in captions:
            check_caption(caption, scene)
            relation_captions += any(re.search(rf"\b{p}\b", caption) for p in RELATION_OF)
        # one caption at least names every object: together they identify the image
        named = [{m.group(2, 3) for m in MENTION.finditer(c)} for c in captions]
        assert any(n == {(o.color, o.shape) for o in scene.objects} for n in named)
    assert relation_captions > 400  # relations are common, not a rare template


def test_caption_checker_catches_false_captions():
    left = SceneObject("circle", "red", "small", [10, 50, 30, 70])
    right = SceneObject("square", "blue", "large", [70, 40, 110, 80])
    scene = type("S", (), {"objects": [left, right], "width": 128, "height": 128})()
    check_caption("a red circle to the left of a large blue square", scene)
    for false in (
        "a blue square to the left of a red circle",
        "a green circle",
        "a large red circle",
        "a red circle bigger than a blue square",
        "three shapes: a red circle and a blue square",
        "a red circle above a blue square",
        "a blue square in the top left corner",
        "a red circle near the right edge",
        "a single red circle",
    ):
        with pytest.raises(AssertionError):
            check_caption(false, scene)


def test_captions_are_deterministic():
    scene = generate_scene(random.Random(1))
    assert make_captions(scene, random.Random(2)) == make_captions(scene, random.Random(2))
    words = {w for seed in range(50) for c in make_captions(scene, random.Random(seed)) for w in tokenize(c)}
    assert len(words) > 15  # varied wording, not one fixed template


# --- region features -----------------------------------------------------------------------


def _square_image(color: str, side: int, cx: int = 64, cy: int = 64):
    r = side // 2
    box = [cx - r, cy - r, cx + r, cy + r]
    points = [(box[0], box[1]), (box[2] - 1, box[1]), (box[2] - 1, box[3] - 1), (box[0], box[3] - 1)]
    obj = SceneObject("square", color, "large", box, points)
    return render([obj], 128, 128, random.Random(0)), box


def test_region_features_carry_colour_information():
    extractor = RegionFeatureExtractor(input_size=64)
    items = [_square_image("red", 40), _square_image("red", 38), _square_image("blue", 40), _square_image("green", 40)]
    feats = extractor.extract([im for im, _ in items], [[[0, 0, 128, 128], box] for _, box in items])
    assert all(f.shape == (2, 2048) and f.dtype == np.float16 and np.isfinite(f).all() for f in feats)
    obj = [f[1].astype(np.float32) for f in feats]
    same_colour = np.linalg.norm(obj[0] - obj[1])  # a slightly smaller red square
    assert np.linalg.norm(obj[0] - obj[2]) > 1.5 * same_colour  # measured: about 2.5x
    assert np.linalg.norm(obj[0] - obj[3]) > 1.5 * same_colour
    assert np.abs(feats[0]).max() < 1000  # fixed rescale keeps random-init features at a sane size
    # the box matters: the whole image and the object region differ
    assert np.linalg.norm(feats[0][0].astype(np.float32) - obj[0]) > same_colour


def test_extractor_is_reproducible_and_checks_its_arguments():
    image, box = _square_image("red", 40)
    a = RegionFeatureExtractor(input_size=32).extract([image], [[box]])[0]
    b = RegionFeatureExtractor(input_size=32).extract([image], [[box]])[0]
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="box lists"):
        RegionFeatureExtractor(input_size=32).extract([image], [])
    with pytest.raises(ValueError, match="ResNet"):
        RegionFeatureExtractor(backbone="vit_b_16")


def test_calibrated_features_are_standardised_and_stage_sets_the_size():
    import random as _random

    from vldist.shards.synthetic.scenes import generate_scene

    rng = _random.Random(5)
    scenes = [generate_scene(rng, 64) for _ in range(24)]
    images = [s.image for s in scenes]
    boxes = [[[0, 0, 64, 64]] + [list(o.box) for o in s.objects] for s in scenes]
    extractor = RegionFeatureExtractor(input_size=32, layer="layer2", grid=2)
    assert extractor.dim == 512 * 4
    raw = np.concatenate(extractor.extract(images, boxes)).astype(np.float32)
    assert np.linalg.norm(raw.mean(0)) > 0.9 * np.linalg.norm(raw, axis=1).mean()  # one dominant direction
    extractor.calibrate(images, boxes)
    rows = np.concatenate(extractor.extract(images, boxes)).astype(np.float32)
    assert np.abs(rows.mean(0)).max() < 0.01
    spread = rows.std(0, ddof=1)
    assert np.mean(np.abs(spread - 1) < 0.02) > 0.95  # a few near-constant dims stay below 1
    assert RegionFeatureExtractor(input_size=32, layer="layer1", grid=1).dim == 256
    with pytest.raises(ValueError, match="layer must be one of"):
        RegionFeatureExtractor(input_size=32, layer="layer5")
