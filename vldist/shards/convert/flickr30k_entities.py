"""`flickr30k_entities`: Flickr30K Entities (Plummer et al., 2015) for phrase localisation.

--src is the flickr30k_entities folder (github.com/BryanPlummer/flickr30k_entities, annotations.zip
unpacked): `Annotations/<id>.xml`, `Sentences/<id>.txt` and the split lists `train.txt`, `val.txt`,
`test.txt` (one image id per line: 29,783 / 1,000 / 1,000). --images is the flickr30k-images folder
(`<id>.jpg`; default `<src>/flickr30k-images`). Samples follow the split lists' order.

Each `Sentences/<id>.txt` line is a caption with its phrases marked up as
`[/EN#<entity>/<type>[/<type>...] <phrase words>]`; the sample's `captions` are those lines with the
markup removed and whitespace normalised. Each `Annotations/<id>.xml` gives the image's
<size><width>/<height> and <object>s, each naming one or more entities (<name>) with a <bndbox>
or <nobndbox> (scene and non-visual entities). `objects` holds one entry per phrase occurrence
whose entity has a box: {"phrase", "box", "sentence" (index into captions), "entity", "type" (the
markup's types joined by "/": "people/other"), "types", "region"}. An entity with several boxes is
localised by their union, as in Plummer et al.'s protocol and the two-branch paper; entity 0
(notvisual) and entities without a box are not queries.

Boxes: the XML's are 1-based inclusive pixel indices, so a box covers the continuous pixel area
[xmin - 1, xmax] x [ymin - 1, ymax]; vldist's boxes are continuous [x0, y0, x1, y1], hence
x0 = xmin - 1, y0 = ymin - 1, x1 = xmax, y1 = ymax, clipped to the image (a few annotations
overhang it by a pixel). A box with nothing left inside the image is bad input.

With features (the default), each distinct union box is a region row after the grid cells:
regions.npy = the --region-grid cells, then the object boxes, and an object's `region` is its row
in `region_boxes`. Proposals (candidate boxes ranked by the phrase localisation recipe) are
`proposal_boxes` in the JSON and `proposals.npy`, from the same backbone pass: `--proposals FILE`
reads them from a JSON object {"<image id>": [[x0, y0, x1, y1], ...]} (e.g. the paper's 200
EdgeBoxes, computed elsewhere), keeping the first --max-proposals of each image as ranked; else
--proposals-per-image N boxes are generated from the image size alone (the whole image, a grid,
then random boxes, seeded by the image id). They never look at the annotated boxes: proposals
built around the ground truth would leak the answer. `--proposals-per-image 0` writes none.
"""

from __future__ import annotations

import random
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Problems
from vldist.shards.convert.images import ImageSamples, add_feature_arguments, feature_options, image_plan
from vldist.shards.convert.karpathy import read_json
from vldist.shards.synthetic.proposals import make_proposals

SPLITS = ("train", "val", "test")
NOT_VISUAL = "0"  # the entity id of phrases that name nothing in the image
PROPOSAL_SEED = "vldist-flickr30k-entities-proposals"
LAYOUT = "--src must be the flickr30k_entities folder (Annotations/, Sentences/, train.txt, val.txt, test.txt)"

# One marked-up phrase: [/EN#<entity>/<type>[/<type>...] <words>]
_PHRASE = re.compile(r"\[/EN#(\d+)((?:/[^\s/\[\]]+)+)\s+([^\[\]]*)\]")


# ------------------------------------------------------------------------------ annotations


@dataclass
class Annotation:
    width: int
    height: int
    boxes: dict[str, list[list]]  # entity id -> its boxes, vldist pixel coordinates


def _number(text: str | None, what: str, where: str):
    if text is None:
        raise BadInput(where, f"has no {what}")
    try:
        value = float(text.strip())
    except ValueError:
        raise BadInput(where, f"{what} {text!r} is not a number") from None
    return int(value) if value.is_integer() else value


def pixel_box(xmin, ymin, xmax, ymax, width: int, height: int) -> list | None:
    """1-based inclusive pixel indices -> continuous [x0, y0, x1, y1] clipped to the image; None
    when no part of the box lies inside it."""
    x0, y0, x1, y1 = max(0, xmin - 1), max(0, ymin - 1), min(width, xmax), min(height, ymax)
    return [x0, y0, x1, y1] if x1 > x0 and y1 > y0 else None


def read_annotation(path: Path) -> Annotation:
    """Parse one Annotations/<id>.xml; BadInput names the file (and the line and column of a
    syntax error, or the object of a bad box)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        line, column = err.position
        reason = str(err).split(":")[0]  # the message without expat's own 0-based position
        raise BadInput(f"{path} line {line} column {column + 1}", f"is not well-formed XML ({reason})") from None
    width = _number(root.findtext("size/width"), "<size><width>", str(path))
    height = _number(root.findtext("size/height"), "<size><height>", str(path))
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        raise BadInput(str(path), f"has image size {width} x {height}; expected positive whole <width> and <height>")
    boxes: dict[str, list[list]] = {}
    for index, obj in enumerate(root.iter("object"), 1):
        bndbox = obj.find("bndbox")
        if bndbox is None:  # <nobndbox>: a scene or non-visual entity
            continue
        where = f"{path} object {index}"
        corners = [_number(bndbox.findtext(k), f"<{k}>", where) for k in ("xmin", "ymin", "xmax", "ymax")]
        box = pixel_box(*corners, width, height)
        if box is None:
            raise BadInput(
                where,
                f"box xmin, ymin, xmax, ymax = {corners} lies outside the {width} x {height} image "
                "or is empty; fix or remove the object (--on-error skip leaves the image out)",
            )
        for name in obj.iter("name"):
            boxes.setdefault((name.text or "").strip(), []).append(box)
    return Annotation(width, height, boxes)


def union(boxes: list[list]) -> list:
    return [min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)]


# -------------------------------------------------------------------------------- sentences


@dataclass
class Phrase:
    text: str
    entity: str
    types: list[str]


def parse_sentence(line: str, where: str) -> tuple[str, list[Phrase]]:
    """(caption without markup, its phrases in order); BadInput names the column of a bracket
    that is not part of a well-formed `[/EN#id/type words]`."""
    words, phrases, end = [], [], 0
    for match in _PHRASE.finditer(line):
        _check_plain(line, end, match.start(), where)
        text = " ".join(match.group(3).split())
        if not text:
            raise BadInput(f"{where} column {match.start() + 1}", f"phrase {match.group(0)!r} has no words")
        words += [line[end : match.start()], text]
        phrases.append(Phrase(text, match.group(1), match.group(2).strip("/").split("/")))
        end = match.end()
    _check_plain(line, end, len(line), where)
    words.append(line[end:])
    return " ".join("".join(words).split()), phrases


def _check_plain(line: str, start: int, stop: int, where: str) -> None:
    """Text between phrases holds no bracket: one there is markup that did not parse."""
    for column, char in enumerate(line[start:stop], start + 1):
        if char in "[]":
            raise BadInput(
                f"{where} column {column}",
                f"{char!r} is not part of a well-formed phrase '[/EN#<id>/<type> <words>]'; fix the markup",
            )


def read_sentences(path: Path) -> list[tuple[str, list[Phrase]]]:
    """The non-empty lines of one Sentences/<id>.txt, parsed."""
    if not path.is_file():
        raise BadInput(str(path), "is missing: each image of the split lists needs its Sentences/<id>.txt")
    lines = path.read_text(encoding="utf-8").splitlines()
    sentences = [parse_sentence(line, f"{path} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not sentences:
        raise BadInput(str(path), "holds no sentence")
    return sentences


def image_objects(
    sentences: list[tuple[str, list[Phrase]]], boxes: dict[str, list[list]], first_row: int | None
) -> tuple[list[dict], list[list]]:
    """(objects, distinct union boxes in first-seen order). With `first_row` (features on), each
    object's `region` is first_row + the index of its box among the distinct ones."""
    rows: dict[tuple, int] = {}
    objects = []
    for index, (_, phrases) in enumerate(sentences):
        for phrase in phrases:
            entity_boxes = boxes.get(phrase.entity) if phrase.entity != NOT_VISUAL else None
            if not entity_boxes:  # notvisual, or a scene / nobndbox entity: nothing to localise
                continue
            box = union(entity_boxes)
            row = rows.setdefault(tuple(box), len(rows))
            obj = {
                "phrase": phrase.text,
                "box": box,
                "sentence": index,
                "entity": phrase.entity,
                "type": "/".join(phrase.types),
                "types": phrase.types,
            }
            if first_row is not None:
                obj["region"] = first_row + row
            objects.append(obj)
    return objects, [list(box) for box in rows]


# -------------------------------------------------------------------------------- proposals


def generated_proposals(image_id: str, width: int, height: int, count: int) -> list[list[int]]:
    """`count` boxes from the image size and id alone: make_proposals without object boxes gives
    the whole image, the grid cells, then random boxes of a stream seeded by the image id."""
    return make_proposals(width, height, [], count, random.Random(f"{PROPOSAL_SEED}:{image_id}"))


def file_proposals(boxes, image_id: str, width: int, height: int, cap: int, where: str) -> list[list]:
    """The first `cap` boxes the file ranks for the image, clipped to it."""
    if not isinstance(boxes, list) or not boxes:
        raise BadInput(
            where,
            f"has no proposals for image {image_id}; give every image of the split lists a "
            "non-empty list of [x0, y0, x1, y1] boxes",
        )
    kept = []
    for index, box in enumerate(boxes[:cap]):
        if not (
            isinstance(box, list)
            and len(box) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)
        ):
            raise BadInput(f"{where}[{index}]", f"{box!r} is not a box [x0, y0, x1, y1] of numbers")
        x0, y0, x1, y1 = max(0, box[0]), max(0, box[1]), min(width, box[2]), min(height, box[3])
        if x1 <= x0 or y1 <= y0:
            raise BadInput(
                f"{where}[{index}]",
                f"box {box} lies outside the {width} x {height} image or is empty; "
                "boxes must be [x0, y0, x1, y1] pixels (not x, y, width, height)",
            )
        kept.append([x0, y0, x1, y1])
    return kept


# ------------------------------------------------------------------------------ the converter


@dataclass
class _Source:
    """What planning one image needs beyond its id."""

    src: Path
    images: Path
    first_row: int | None  # the region row of the first object box (None: no features)
    proposals: dict | None  # the proposal options
    proposals_file: Path | None
    table: dict | None  # the proposals file's image id -> boxes


def read_split_ids(path: Path) -> list[str]:
    if not path.is_file():
        raise BadInput(str(path), f"is missing; {LAYOUT}")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class Flickr30kEntitiesConverter(Converter):
    name = "flickr30k_entities"
    version = 1
    summary = "Flickr30K Entities: captions with phrases and their boxes, and proposals (phrase localisation)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--images",
            type=Path,
            default=None,
            help="the flickr30k-images folder, <id>.jpg (default: <src>/flickr30k-images)",
        )
        parser.add_argument(
            "--proposals",
            type=Path,
            default=None,
            metavar="FILE",
            help="JSON object: image id -> ranked [x0, y0, x1, y1] boxes (e.g. EdgeBoxes); "
            "default: boxes generated from each image's size",
        )
        parser.add_argument(
            "--max-proposals",
            type=int,
            default=200,
            metavar="N",
            help="with --proposals: keep each image's first N boxes (default 200, as the paper)",
        )
        parser.add_argument(
            "--proposals-per-image",
            type=int,
            default=100,
            metavar="N",
            help="without --proposals: N generated boxes per image (default 100; 0: none)",
        )
        add_feature_arguments(parser, default_on=True)

    @classmethod
    def options(cls, args) -> dict:
        return {"proposals": cls._proposal_options(args), "features": feature_options(args)}

    @staticmethod
    def _proposal_options(args) -> dict | None:
        if args.proposals is not None:
            if args.max_proposals < 1:
                raise ValueError(f"--max-proposals must be at least 1, got {args.max_proposals}")
            return {"source": "file", "max": args.max_proposals}
        if args.proposals_per_image < 0:
            raise ValueError(f"--proposals-per-image must be 0 or more, got {args.proposals_per_image}")
        return {"source": "generated", "count": args.proposals_per_image} if args.proposals_per_image else None

    @classmethod
    def plan(cls, args, problems: Problems):
        src = Path(args.src)
        images_root = Path(args.images) if args.images else src / "flickr30k-images"
        for folder in ("Annotations", "Sentences"):
            if not (src / folder).is_dir():
                raise BadInput(str(src / folder), f"is not a folder; {LAYOUT}")
        split_ids = {split: read_split_ids(src / f"{split}.txt") for split in SPLITS}
        features = feature_options(args)
        source = _Source(
            src,
            images_root,
            first_row=features["region_grid"] ** 2 if features else None,
            proposals=cls._proposal_options(args),
            proposals_file=args.proposals,
            table=cls._proposal_table(args.proposals) if args.proposals is not None else None,
        )
        splits: dict[str, list[Item]] = {split: [] for split in SPLITS}
        seen: dict[str, str] = {}
        for split, ids in split_ids.items():
            for line, image_id in enumerate(ids, 1):
                where = f"{src / f'{split}.txt'} line {line} ({image_id})"
                if image_id in seen:  # the same image twice would leak between splits or weigh double
                    problems.report(where, f"lists image {image_id} again (first: {seen[image_id]})", split=split)
                    continue
                seen[image_id] = where
                try:
                    item = cls._item(source, split, image_id, where, f"{split}-{len(splits[split]):07d}")
                except BadInput as bad:
                    problems.report(bad.where, bad.what, split=split)
                    continue
                splits[split].append(item)
        splits = {name: items for name, items in splits.items() if items}
        return image_plan(splits, cls._inputs(src, args), args, problems.skipped, cls._features_extra(splits, source))

    @classmethod
    def _item(cls, source: _Source, split: str, image_id: str, where: str, key: str) -> Item:
        xml = source.src / "Annotations" / f"{image_id}.xml"
        if not xml.is_file():
            raise BadInput(where, f"has no annotation {xml}; is --src the flickr30k_entities folder, and the id right?")
        annotation = read_annotation(xml)
        sentences = read_sentences(source.src / "Sentences" / f"{image_id}.txt")
        objects, extra = image_objects(sentences, annotation.boxes, source.first_row)
        size = [annotation.width, annotation.height]
        data = {
            "images": {"": str(source.images / f"{image_id}.jpg")},
            "sizes": {"": size},
            "meta": {"image_id": image_id, "filename": f"{image_id}.jpg", "objects": objects},
        }
        if source.first_row is not None and extra:
            data["extra_boxes"] = {"": extra}
        if source.proposals is not None:
            data["proposal_boxes"] = {"": cls._proposals(source, image_id, size)}
        return Item(key, split, where, [caption for caption, _ in sentences], data)

    @staticmethod
    def _proposals(source: _Source, image_id: str, size: list[int]) -> list[list]:
        options = source.proposals
        if options["source"] == "generated":
            return generated_proposals(image_id, *size, options["count"])
        return file_proposals(
            source.table.get(image_id), image_id, *size, options["max"], f"{source.proposals_file} [{image_id!r}]"
        )

    @staticmethod
    def _proposal_table(path: Path) -> dict:
        table = read_json(path)
        if not isinstance(table, dict):
            raise BadInput(str(path), "is not a JSON object of image id -> list of [x0, y0, x1, y1] boxes")
        return table

    @staticmethod
    def _inputs(src: Path, args) -> dict:
        inputs = {
            "dataset": "Flickr30K Entities",
            "files": {f"{split}.txt": sha256_file(src / f"{split}.txt") for split in SPLITS},
        }
        if args.proposals is not None:
            inputs["proposals"] = {"file": Path(args.proposals).name, "sha256": sha256_file(args.proposals)}
        return inputs

    @staticmethod
    def _features_extra(splits: dict[str, list[Item]], source: _Source) -> dict:
        """What the manifest's features say beyond the grid: object rows, and the proposals the
        phrase localisation recipe checks for before it starts."""
        if source.first_row is None:
            return {}
        items = [item for split in splits.values() for item in split]
        most_objects = max((len(item.data.get("extra_boxes", {}).get("", [])) for item in items), default=0)
        extra = {"regions": "grid+objects", "max_regions": source.first_row + most_objects}
        if source.proposals is not None:
            extra["proposals"] = "file" if source.proposals["source"] == "file" else source.proposals["count"]
        return extra

    @classmethod
    def worker(cls, setup):
        return ImageSamples(setup)
