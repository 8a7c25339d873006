"""`birds_to_words`: Birds-to-Words (Forbes et al., 2019) image pairs with comparative descriptions, for L2C.

--src is `birds-to-words-v1.0.tsv`: tab-separated, a header line, then one row per description:
img1ObservationURL, img1ImgURL, img1Species, img1Selection, img2ObservationURL, img2ImgURL,
img2Species, img2Selection, split, annN, description. Rows of one pair (same two image URLs and
split) become one sample holding both images (`img1.jpg`, `img2.jpg`) and their descriptions in
annN order (about 5; 3,347 pairs in all). The images are read from --images: the file for an
iNaturalist URL `.../photos/<N>/medium.jpg` is `<images>/<N>.jpg`, any other URL's file is its last
path segment; --image-map (a TSV of `url<TAB>path`) overrides both.
"""

from __future__ import annotations

import csv
from pathlib import Path
from urllib.parse import urlparse

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Problems
from vldist.shards.convert.images import ImageSamples, add_feature_arguments, feature_options, image_plan

COLUMNS = (
    "img1ObservationURL",
    "img1ImgURL",
    "img1Species",
    "img1Selection",
    "img2ObservationURL",
    "img2ImgURL",
    "img2Species",
    "img2Selection",
    "split",
    "annN",
    "description",
)
SPLITS = ("train", "val", "test")


def local_name(url: str) -> str:
    """The default file name of an image URL (see the module docstring)."""
    parts = [p for p in urlparse(url).path.split("/") if p]
    if not parts:
        return ""
    suffix = Path(parts[-1]).suffix or ".jpg"
    if len(parts) >= 2 and parts[-2].isdigit() and "photos" in parts:
        return parts[-2] + suffix
    return parts[-1]


class BirdsToWordsConverter(Converter):
    name = "birds_to_words"
    version = 1
    summary = "Birds-to-Words image pairs with comparative descriptions (L2C)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--images", type=Path, required=True, help="folder holding the downloaded images")
        parser.add_argument(
            "--image-map",
            type=Path,
            default=None,
            help="TSV of `url<TAB>path` (path relative to --images) for other naming schemes",
        )
        add_feature_arguments(parser, default_on=False)

    @classmethod
    def options(cls, args) -> dict:
        return {"features": feature_options(args)}

    @classmethod
    def plan(cls, args, problems: Problems):
        src, images = Path(args.src), Path(args.images)
        if not src.is_file():
            raise BadInput(str(src), "does not exist; --src is birds-to-words-v1.0.tsv")
        mapping = cls._image_map(args.image_map)
        pairs: dict[tuple, dict] = {}
        with open(src, encoding="utf-8", newline="") as f:
            for number, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
                if number == 1 and row and row[0] == COLUMNS[0]:
                    if tuple(row[: len(COLUMNS)]) != COLUMNS:
                        raise BadInput(f"{src} line 1", f"has columns {row}; expected {', '.join(COLUMNS)}")
                    continue
                where = f"{src} line {number}"
                if not any(field.strip() for field in row):
                    continue
                if len(row) != len(COLUMNS):
                    problems.report(where, f"has {len(row)} tab-separated fields; expected {len(COLUMNS)}")
                    continue
                fields = dict(zip(COLUMNS, row, strict=True))
                if fields["split"] not in SPLITS:
                    problems.report(where, f"has split {fields['split']!r}; expected one of {', '.join(SPLITS)}")
                    continue
                if not fields["description"].strip() or not fields["annN"].strip().isdigit():
                    problems.report(where, "has an empty description or a non-numeric annN")
                    continue
                pair = (fields["img1ImgURL"], fields["img2ImgURL"], fields["split"])
                entry = pairs.setdefault(pair, {"where": where, "fields": fields, "descriptions": []})
                entry["descriptions"].append((int(fields["annN"]), number, fields["description"].strip()))
        splits: dict[str, list[Item]] = {split: [] for split in SPLITS}
        for (url1, url2, split), entry in pairs.items():
            fields, items = entry["fields"], splits[split]
            paths, meta = {}, {}
            for side, url in (("img1", url1), ("img2", url2)):
                name = mapping.get(url) or local_name(url)
                paths[side] = str(images / name)
                meta[side] = {
                    "image_url": url,
                    "observation_url": fields[f"{side}ObservationURL"],
                    "species": fields[f"{side}Species"],
                    "selection": fields[f"{side}Selection"],
                    "filename": name,
                }
            descriptions = [text for _, _, text in sorted(entry["descriptions"])]
            items.append(
                Item(
                    f"{split}-{len(items):07d}",
                    split,
                    f"{entry['where']} (pair {url1} | {url2})",
                    descriptions,
                    {"images": paths, "meta": meta},
                )
            )
        splits = {name: items for name, items in splits.items() if items}
        inputs = {"dataset": "birds-to-words", "index": src.name, "index_sha256": sha256_file(src)}
        if args.image_map:
            inputs["image_map_sha256"] = sha256_file(args.image_map)
        return image_plan(splits, inputs, args, problems.skipped)

    @staticmethod
    def _image_map(path: Path | None) -> dict[str, str]:
        if path is None:
            return {}
        mapping = {}
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                url, sep, local = line.partition("\t")
                if not sep or not local.strip():
                    raise BadInput(f"{path} line {number}", "is not `url<TAB>path`")
                mapping[url.strip()] = local.strip()
        return mapping

    @classmethod
    def worker(cls, setup):
        return ImageSamples(setup)
