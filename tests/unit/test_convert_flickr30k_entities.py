"""The flickr30k_entities converter on a miniature of the real layout (tests/fixtures/flickr30k_entities:
Annotations/*.xml, Sentences/*.txt, train/val/test.txt; the images are drawn here at the XML's sizes).

Expected captions and objects come from a reimplementation of the dataset's own reader
(flickr30k_entities_utils.py: words split on spaces, '[' opens a phrase, ']' closes it) and from
the XML read here, not from the converter's code."""

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from helpers import npy_load, read_shard_set
from PIL import Image

from vldist.shards.__main__ import main
from vldist.shards.format.verify import verify

FIXTURE = Path(__file__).parents[1] / "fixtures" / "flickr30k_entities"
GRID = 2
SMALL_FEATURES = ["--backbone", "resnet18", "--feature-size", "32", "--region-grid", str(GRID)]
SPLITS = ("train", "val", "test")


# ----------------------------------------------------------------------------- the dataset


@pytest.fixture
def dataset(tmp_path) -> Path:
    """The fixture copied, with a noise JPEG of each annotation's size in flickr30k-images/."""
    root = tmp_path / "flickr30k_entities"
    shutil.copytree(FIXTURE, root)
    (root / "flickr30k-images").mkdir()
    for seed, xml in enumerate(sorted((root / "Annotations").glob("*.xml"))):
        width, height = xml_size(xml)
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "flickr30k-images" / f"{xml.stem}.jpg", quality=90)
    return root


def split_ids(root: Path) -> dict[str, list[str]]:
    return {split: (root / f"{split}.txt").read_text().split() for split in SPLITS}


def xml_size(xml: Path) -> tuple[int, int]:
    annotation = ET.parse(xml).getroot()
    return int(annotation.findtext("size/width")), int(annotation.findtext("size/height"))


def entity_boxes(xml: Path) -> dict[str, list[list[int]]]:
    """entity -> boxes, 1-based inclusive pixels made continuous: [xmin - 1, ymin - 1, xmax, ymax], clipped."""
    width, height = xml_size(xml)
    boxes = {}
    for obj in ET.parse(xml).getroot().iter("object"):
        if obj.find("bndbox") is None:
            continue
        xmin, ymin, xmax, ymax = (int(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax"))
        box = [max(0, xmin - 1), max(0, ymin - 1), min(width, xmax), min(height, ymax)]
        for name in obj.findall("name"):
            boxes.setdefault(name.text, []).append(box)
    return boxes


def reference_sentence(line: str) -> tuple[str, list[dict]]:
    """(caption, phrases) the way flickr30k_entities_utils.get_sentence_data reads a line."""
    words, phrases, current, inside = [], [], [], False
    for token in line.split():
        if inside:
            if token.endswith("]"):
                inside, token = False, token[:-1]
                current.append(token)
                phrases[-1]["text"] = " ".join(current)
                current = []
            else:
                current.append(token)
            words.append(token)
        elif token.startswith("["):
            inside = True
            parts = token.split("/")
            phrases.append({"entity": parts[1][3:], "types": parts[2:]})
        else:
            words.append(token)
    return " ".join(words), phrases


def expected_sample(root: Path, image_id: str) -> tuple[list[str], list[dict]]:
    """(captions, objects without `region`): each phrase of a boxed entity, its box the union."""
    boxes = entity_boxes(root / "Annotations" / f"{image_id}.xml")
    captions, objects = [], []
    for index, line in enumerate((root / "Sentences" / f"{image_id}.txt").read_text().splitlines()):
        caption, phrases = reference_sentence(line)
        captions.append(caption)
        for phrase in phrases:
            own = boxes.get(phrase["entity"]) if phrase["entity"] != "0" else None
            if own:
                union = [min(b[0] for b in own), min(b[1] for b in own), max(b[2] for b in own), max(b[3] for b in own)]
                objects.append(
                    {
                        "phrase": phrase["text"],
                        "box": union,
                        "sentence": index,
                        "entity": phrase["entity"],
                        "type": "/".join(phrase["types"]),
                        "types": phrase["types"],
                    }
                )
    return captions, objects


def run(capsys, root: Path, out: Path, *extra):
    code = main(
        [
            "convert",
            "flickr30k_entities",
            "--src",
            str(root),
            "--out",
            str(out),
            "--quiet",
            "--workers",
            "1",
            "--shard-size",
            "2",
            *map(str, extra),
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def converted(capsys, root: Path, out: Path, *extra):
    code, text = run(capsys, root, out, *extra)
    assert code == 0, text
    assert verify(out).ok, verify(out).problems
    return json.loads((out / "manifest.json").read_text()), read_shard_set(out)


def metas(samples) -> dict[str, dict]:
    """image id -> the sample's JSON, over every split."""
    return {
        meta["image_id"]: meta
        for split in samples.values()
        for meta in (json.loads(members["json"]) for _, members in split)
    }


# -------------------------------------------------------------------------------- the tests


def test_captions_objects_regions_and_proposals(dataset, tmp_path, capsys):
    count = 12
    manifest, samples = converted(capsys, dataset, tmp_path / "out", *SMALL_FEATURES, "--proposals-per-image", count)

    ids = split_ids(dataset)
    assert {s: e["samples"] for s, e in manifest["splits"].items()} == {s: len(v) for s, v in ids.items()}
    features = manifest["features"]
    assert features["proposals"] == count and features["regions"] == "grid+objects"
    assert manifest["conversion"]["options"]["proposals"] == {"source": "generated", "count": count}
    for split in SPLITS:
        for (_key, members), image_id in zip(samples[split], ids[split], strict=True):
            meta = json.loads(members["json"])
            assert meta["image_id"] == image_id and meta["split"] == split
            assert members["jpg"] == (dataset / "flickr30k-images" / f"{image_id}.jpg").read_bytes()
            captions, objects = expected_sample(dataset, image_id)
            assert meta["captions"] == captions
            assert [{k: v for k, v in o.items() if k != "region"} for o in meta["objects"]] == objects
            check_rows(meta, members, features["dim"])

    first = metas(samples)["1000092795"]
    # literal spot checks of the same file, worked out by hand
    assert first["captions"][0] == "A child in a pink dress is climbing up a set of stairs in an entry way ."
    assert first["captions"][2] == "Someone watches the child on the steps ."  # entity 0: words kept, no object
    dress = [o for o in first["objects"] if o["entity"] == "19"][0]
    # two boxes (30,10)-(44,30) and (40,20)-(66,45) in 1-based pixels, the second clipped at width 64
    assert dress["phrase"] == "a pink dress" and dress["box"] == [30 - 1, 10 - 1, 64, 45]
    girl = [o for o in first["objects"] if o["phrase"] == "A little girl"][0]
    assert girl["type"] == "people/other" and girl["types"] == ["people", "other"] and girl["sentence"] == 1
    assert not [o for o in first["objects"] if o["entity"] in ("0", "20", "23")]  # notvisual, nobndbox, no box
    # entities 21 and 22 share one box: one region row for both
    assert len({o["region"] for o in first["objects"] if o["entity"] in ("21", "22")}) == 1


def check_rows(meta: dict, members: dict, dim: int) -> None:
    """Regions: the grid cells then each distinct object box, one row each; proposals aligned."""
    width, height = meta["width"], meta["height"]
    regions, proposals = npy_load(members["regions.npy"]), npy_load(members["proposals.npy"])
    boxes = meta["region_boxes"]
    assert regions.shape == (len(boxes), dim)
    assert boxes[: GRID * GRID] == [
        [
            round(width * c / GRID),
            round(height * r / GRID),
            round(width * (c + 1) / GRID),
            round(height * (r + 1) / GRID),
        ]
        for r in range(GRID)
        for c in range(GRID)
    ]
    unions = list(dict.fromkeys(tuple(o["box"]) for o in meta["objects"]))
    assert [tuple(b) for b in boxes[GRID * GRID :]] == unions
    for obj in meta["objects"]:
        assert boxes[obj["region"]] == obj["box"]
    assert proposals.shape == (len(meta["proposal_boxes"]), dim)
    # the same extractor in the same pass: a proposal that is also a region box has its row
    shared = [(p, boxes.index(box)) for p, box in enumerate(meta["proposal_boxes"]) if box in boxes]
    assert shared  # the grid cells are among the generated proposals
    for p, r in shared:
        np.testing.assert_array_equal(proposals[p], regions[r])


def test_generated_proposals_ignore_the_annotated_boxes(dataset, tmp_path, capsys):
    count = 20
    _, before = converted(capsys, dataset, tmp_path / "before", "--no-features", "--proposals-per-image", count)
    for xml in (dataset / "Annotations").glob("*.xml"):  # every box moved by one pixel
        text = re.sub(r"<(xmin|ymin)>(\d+)<", lambda m: f"<{m[1]}>{int(m[2]) + 1}<", xml.read_text())
        xml.write_text(text)
    _, after = converted(capsys, dataset, tmp_path / "after", "--no-features", "--proposals-per-image", count)

    before, after = metas(before), metas(after)
    for image_id, meta in before.items():
        assert meta["objects"] != after[image_id]["objects"]
        assert meta["proposal_boxes"] == after[image_id]["proposal_boxes"]
        proposals, width, height = meta["proposal_boxes"], meta["width"], meta["height"]
        assert len(proposals) == count and len({tuple(b) for b in proposals}) == count
        assert proposals[0] == [0, 0, width, height]
        assert all(0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height for x0, y0, x1, y1 in proposals)
    assert before["1000092795"]["proposal_boxes"] != before["1000344755"]["proposal_boxes"]


def test_proposals_file_is_ranked_capped_and_clipped(dataset, tmp_path, capsys):
    ranked = {}
    for xml in (dataset / "Annotations").glob("*.xml"):
        width, height = xml_size(xml)
        # the second box overhangs the image; the last two are beyond the cap
        ranked[xml.stem] = [
            [1, 2, width - 3, height - 4],
            [5, 0, width + 10, height],
            [0, 0, 8, 8],
            [2, 2, 9, 9],
            [3, 3, 10, 10],
        ]
    file = tmp_path / "edgeboxes.json"
    file.write_text(json.dumps(ranked))
    cap = 3
    manifest, samples = converted(
        capsys, dataset, tmp_path / "out", *SMALL_FEATURES, "--proposals", file, "--max-proposals", cap
    )

    assert manifest["features"]["proposals"] == "file"
    assert manifest["conversion"]["options"]["proposals"] == {"source": "file", "max": cap}
    assert manifest["conversion"]["inputs"]["proposals"]["file"] == file.name
    for split in samples.values():
        for _, members in split:
            meta = json.loads(members["json"])
            width, height = meta["width"], meta["height"]
            wanted = [box[:] for box in ranked[meta["image_id"]][:cap]]
            wanted[1][2] = width  # clipped to the image
            assert meta["proposal_boxes"] == wanted
            assert npy_load(members["proposals.npy"]).shape == (cap, manifest["features"]["dim"])


def test_no_proposals_for_retrieval_only_sets(dataset, tmp_path, capsys):
    manifest, samples = converted(capsys, dataset, tmp_path / "out", *SMALL_FEATURES, "--proposals-per-image", 0)
    assert "proposals" not in manifest["features"] and manifest["conversion"]["options"]["proposals"] is None
    for split in samples.values():
        for _, members in split:
            assert "proposals.npy" not in members and "proposal_boxes" not in json.loads(members["json"])
            assert "regions.npy" in members


# ----------------------------------------------------------------------------- bad input


def _malformed_xml(root):
    xml = root / "Annotations" / "1000268201.xml"
    lines = xml.read_text().splitlines()
    line = next(n for n, text in enumerate(lines) if "<filename>" in text)
    lines[line] = lines[line].replace("</filename>", "</filenam>")
    xml.write_text("\n".join(lines) + "\n")
    return "val", rf"{re.escape(str(xml))} line {line + 1} column \d+: is not well-formed XML"


def _missing_sentences(root):
    path = root / "Sentences" / "1000344755.txt"
    path.unlink()
    return "test", rf"{re.escape(str(path))}: is missing"


def _malformed_bracket(root):
    path = root / "Sentences" / "10002456.txt"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace("A man]", "A man")  # the phrase's '[' is left open
    path.write_text("\n".join(lines) + "\n")
    column = lines[2].index("[/EN#5") + 1
    return "train", rf"{re.escape(str(path))} line 3 column {column}: '\[' is not part of a well-formed phrase"


def _id_without_annotation(root):
    split_file = root / "test.txt"
    split_file.write_text(split_file.read_text() + "999\n")
    line = len(split_file.read_text().split())
    return "test", (
        rf"{re.escape(str(split_file))} line {line} \(999\): has no annotation "
        rf"{re.escape(str(root / 'Annotations' / '999.xml'))}"
    )


def _box_outside(root):
    xml = root / "Annotations" / "1000092795.xml"
    width, _ = xml_size(xml)
    objects = list(ET.parse(xml).getroot().iter("object"))
    number = next(n for n, obj in enumerate(objects, 1) if obj.findtext("name") == "18")
    xml.write_text(xml.read_text().replace("<xmin>5</xmin>", f"<xmin>{width + 5}</xmin>"))
    return "train", rf"{re.escape(str(xml))} object {number}: box .* lies outside the {width} x \d+ image"


def _missing_image(root):
    image = root / "flickr30k-images" / "1000268201.jpg"
    image.unlink()
    return "val", rf"val.txt line 1 \(1000268201\): image {re.escape(str(image))} does not exist"


def _resized_image(root):
    image = root / "flickr30k-images" / "1000344755.jpg"
    Image.new("RGB", (20, 10)).save(image)
    return "test", rf"image {re.escape(str(image))} is 20 x 10 pixels but its annotation was made on"


@pytest.mark.parametrize(
    "damage",
    [
        _malformed_xml,
        _missing_sentences,
        _malformed_bracket,
        _id_without_annotation,
        _box_outside,
        _missing_image,
        _resized_image,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_bad_input_is_named_then_stopped_on_or_skipped(dataset, tmp_path, capsys, damage):
    split, message = damage(dataset)
    listed = {split: len(ids) for split, ids in split_ids(dataset).items()}

    code, text = run(capsys, dataset, tmp_path / "stop", "--no-features")
    assert code == 2 and re.search(message, text), text
    assert not (tmp_path / "stop" / "manifest.json").exists()

    code, text = run(capsys, dataset, tmp_path / "skip", "--no-features", "--on-error", "skip")
    assert code == 0 and "1 skipped" in text and re.search(f"skipped: .*{message}", text), text
    manifest = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    written = {s: e["samples"] for s, e in manifest["splits"].items()}
    assert written.get(split, 0) == listed[split] - 1  # a split left empty has no entry
    assert manifest["conversion"]["skipped"] == {split: 1}
