"""`karpathy`: COCO or Flickr30K with Karpathy's split file (dataset_coco.json, dataset_flickr30k.json).

The file holds {"dataset": "coco", "images": [...]}, each image with `split` (train, restval, val,
test), `filename`, `filepath` (COCO: train2014 or val2014), `imgid`, `cocoid` (COCO) and
`sentences` [{"raw", "tokens", ...}]. Images are read from `<images>/<filepath>/<filename>`
(Flickr30K: `<images>/<filename>`). As in VSE++ and VSRN, COCO's restval images join train
(113,287 train images), and each image keeps its first 5 sentences (a few COCO images have 6 or 7).
Images keep the order of the file, so the test split is the standard 5K (COCO) or 1K (Flickr30K)
in the standard order, and COCO's 1K protocol folds are its consecutive thousands.
"""

from __future__ import annotations

import json
from pathlib import Path

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Problems
from vldist.shards.convert.images import ImageSamples, add_feature_arguments, feature_options, image_plan

SOURCE_SPLITS = ("train", "restval", "val", "test")


def read_json(path: Path):
    """Parse a JSON file; BadInput names the line and column of a syntax error."""
    if not path.is_file():
        raise BadInput(str(path), "does not exist; check --src")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path} line {err.lineno} column {err.colno}", f"is not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise BadInput(str(path), f"is not UTF-8 text ({err})") from None


class KarpathyConverter(Converter):
    name = "karpathy"
    version = 1
    summary = "COCO / Flickr30K images with Karpathy's dataset_*.json splits"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--images",
            type=Path,
            default=None,
            help="image root: COCO's dir holding train2014/ and val2014/, or Flickr30K's "
            "image dir (default: the directory of --src)",
        )
        parser.add_argument(
            "--restval",
            choices=["train", "keep", "drop"],
            default="train",
            help="COCO's restval images: join train (default, as VSE++/VSRN), keep as their own split, or drop",
        )
        parser.add_argument(
            "--captions-per-image",
            type=int,
            default=5,
            help="keep each image's first N sentences (default 5; 0 keeps all); an image with fewer is bad input",
        )
        add_feature_arguments(parser, default_on=True)

    @classmethod
    def options(cls, args) -> dict:
        return {
            "restval": args.restval,
            "captions_per_image": args.captions_per_image,
            "features": feature_options(args),
        }

    @classmethod
    def plan(cls, args, problems: Problems):
        src = Path(args.src)
        images_root = Path(args.images) if args.images else src.parent
        data = read_json(src)
        if not isinstance(data, dict) or not isinstance(data.get("images"), list):
            raise BadInput(
                str(src),
                "has no top-level 'images' list; is it Karpathy's dataset_coco.json or dataset_flickr30k.json?",
            )
        dataset = str(data.get("dataset", "unknown"))
        cpi = args.captions_per_image
        splits: dict[str, list[Item]] = {"train": [], "val": [], "test": []}
        if args.restval == "keep":
            splits["restval"] = []
        for index, entry in enumerate(data["images"]):
            where = f"{src} images[{index}]"
            try:
                source_split, filename, captions, tokens = cls._entry(entry, cpi)
            except BadInput as bad:
                problems.report(f"{where} {bad.where}".strip(), bad.what)
                continue
            where = f"{where} ({filename})"
            split = source_split
            if source_split == "restval":
                if args.restval == "drop":
                    continue
                split = "train" if args.restval == "train" else "restval"
            path = images_root / entry.get("filepath", "") / filename
            meta = {"source_split": source_split, "filename": filename, "tokens": tokens}
            for name in ("filepath", "imgid", "cocoid"):
                if name in entry:
                    meta[name] = entry[name]
            items = splits[split]
            key = f"{split}-{len(items):07d}"
            items.append(Item(key, split, where, captions, {"images": {"": str(path)}, "meta": meta}))
        splits = {name: items for name, items in splits.items() if items}
        inputs = {"dataset": dataset, "index": src.name, "index_sha256": sha256_file(src)}
        return image_plan(splits, inputs, args, problems.skipped)

    @staticmethod
    def _entry(entry, cpi: int) -> tuple[str, str, list[str], list[list[str]]]:
        if not isinstance(entry, dict):
            raise BadInput("", f"is a {type(entry).__name__}, not an object")
        split, filename, sentences = entry.get("split"), entry.get("filename"), entry.get("sentences")
        if split not in SOURCE_SPLITS:
            raise BadInput("", f"has split {split!r}; expected one of {', '.join(SOURCE_SPLITS)}")
        if not isinstance(filename, str) or not filename:
            raise BadInput("", "has no 'filename'")
        if not isinstance(sentences, list) or not all(
            isinstance(s, dict) and isinstance(s.get("raw"), str) for s in sentences
        ):
            raise BadInput(f"({filename})", "has no 'sentences' list of objects with a 'raw' text")
        sentences = [s for s in sentences if s["raw"].strip()]
        if len(sentences) < max(cpi, 1):
            raise BadInput(
                f"({filename})",
                f"has {len(sentences)} non-empty sentences; --captions-per-image "
                f"{cpi} needs {max(cpi, 1)} (0 keeps each image's own count)",
            )
        if cpi:
            sentences = sentences[:cpi]
        return split, filename, [s["raw"].strip() for s in sentences], [s.get("tokens", []) for s in sentences]

    @classmethod
    def worker(cls, setup):
        return ImageSamples(setup)
