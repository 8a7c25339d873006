"""`folder`: a directory of images with captions, for everyone else's data.

Captions come from either
- a sidecar text file per image, `<name>.txt` beside `<name>.jpg` (one caption per line), or
- one index file (--index, relative to --src or absolute):
  - CSV with a header: `image`, `caption` (one caption per row; rows of one image are grouped in
    file order) and an optional `split` column, or
  - JSONL, one object per line: {"image": "a/b.jpg", "captions": ["...", ...] or "caption": "...",
    "split": optional}.
Image paths are relative to --src. Splits: the index's `split` field; else the top-level folder
when it is train/, val/ or test/; else --split (default train).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Problems
from vldist.shards.convert.images import (
    IMAGE_SUFFIXES,
    ImageSamples,
    add_feature_arguments,
    feature_options,
    image_plan,
)

SPLIT_DIRS = ("train", "val", "test")


class FolderConverter(Converter):
    name = "folder"
    version = 1
    summary = "a folder of images with sidecar .txt captions or a CSV/JSONL index"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--index",
            type=Path,
            default=None,
            help="a .csv or .jsonl caption index (default: a <name>.txt beside each image)",
        )
        parser.add_argument(
            "--split", default="train", help="split of images the index or folder layout does not place (default train)"
        )
        add_feature_arguments(parser, default_on=False)

    @classmethod
    def options(cls, args) -> dict:
        return {
            "index": str(args.index) if args.index else None,
            "split": args.split,
            "features": feature_options(args),
        }

    @classmethod
    def plan(cls, args, problems: Problems):
        src = Path(args.src)
        if not src.is_dir():
            raise BadInput(str(src), "is not a directory; --src is the folder of images")
        if args.index is None:
            entries = cls._sidecars(src, problems)
            inputs = {"dataset": src.name, "index": "sidecar .txt files"}
        else:
            index = args.index if args.index.is_absolute() else src / args.index
            if not index.is_file():
                raise BadInput(str(index), "does not exist; --index is relative to --src or absolute")
            if index.suffix == ".csv":
                entries = cls._csv(index, problems)
            elif index.suffix in (".jsonl", ".json"):
                entries = cls._jsonl(index, problems)
            else:
                raise BadInput(str(index), "is neither .csv nor .jsonl")
            inputs = {"dataset": src.name, "index": index.name, "index_sha256": sha256_file(index)}
        splits: dict[str, list[Item]] = {}
        for image, (where, captions, split) in entries.items():
            split = split or cls._folder_split(image) or args.split
            items = splits.setdefault(split, [])
            items.append(
                Item(
                    f"{split}-{len(items):07d}",
                    split,
                    where,
                    captions,
                    {"images": {"": str(src / image)}, "meta": {"filename": image}},
                )
            )
        return image_plan(splits, inputs, args, problems.skipped)

    @staticmethod
    def _folder_split(image: str) -> str | None:
        top = Path(image).parts[0] if len(Path(image).parts) > 1 else None
        return top if top in SPLIT_DIRS else None

    @staticmethod
    def _sidecars(src: Path, problems: Problems) -> dict[str, tuple]:
        entries = {}
        for path in sorted(p for p in src.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
            image = path.relative_to(src).as_posix()
            sidecar = path.with_suffix(".txt")
            captions = (
                [c.strip() for c in sidecar.read_text(encoding="utf-8").splitlines()] if sidecar.is_file() else []
            )
            captions = [c for c in captions if c]
            if not captions:
                problems.report(str(path), f"has no captions: {sidecar.name} is missing or empty")
                continue
            entries[image] = (str(path), captions, None)
        return entries

    @staticmethod
    def _add(entries: dict, image, caption, split, where: str, problems: Problems) -> None:
        if not isinstance(image, str) or not image.strip():
            problems.report(where, "has no 'image' path")
            return
        captions = caption if isinstance(caption, list) else [caption]
        captions = [c.strip() for c in captions if isinstance(c, str) and c.strip()]
        if not captions:
            problems.report(where, f"has no caption for {image}")
            return
        if split is not None and (not isinstance(split, str) or not split.isidentifier()):
            problems.report(where, f"has split {split!r}; use a word such as train, val or test")
            return
        first_where, known, known_split = entries.get(image, (where, [], split))
        if known_split != split:
            problems.report(where, f"puts {image} in split {split!r}, an earlier line put it in {known_split!r}")
            return
        entries[image] = (first_where, known + captions, split)

    @classmethod
    def _csv(cls, index: Path, problems: Problems) -> dict[str, tuple]:
        entries: dict[str, tuple] = {}
        with open(index, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = {"image", "caption"} - set(reader.fieldnames or [])
            if missing:
                raise BadInput(
                    f"{index} line 1",
                    f"has columns {reader.fieldnames}; needs image and caption (and optionally split)",
                )
            for row in reader:
                cls._add(
                    entries,
                    row.get("image"),
                    row.get("caption"),
                    row.get("split") or None,
                    f"{index} line {reader.line_num}",
                    problems,
                )
        return entries

    @classmethod
    def _jsonl(cls, index: Path, problems: Problems) -> dict[str, tuple]:
        entries: dict[str, tuple] = {}
        for number, line in enumerate(index.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{index} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                problems.report(where, f"is not valid JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(row, dict):
                problems.report(where, "is not a JSON object")
                continue
            cls._add(
                entries, row.get("image"), row.get("captions", row.get("caption")), row.get("split"), where, problems
            )
        return entries

    @classmethod
    def worker(cls, setup):
        return ImageSamples(setup)
