"""`cub`: CUB-200-2011 images with the 10 captions per image of Reed et al. (2016).

--src is the CUB_200_2011 folder: `images.txt` (`<id> <class dir>/<file>.jpg`), `images/`,
`classes.txt`, `image_class_labels.txt`, `bounding_boxes.txt` (`<id> <x> <y> <w> <h>`) and
`train_test_split.txt` (`<id> <1 train | 0 test>`). --text is Reed's cvpr2016_cub folder:
`text_c10/<class dir>/<file>.txt` (one caption per line) and the class lists `trainclasses.txt`,
`valclasses.txt`, `testclasses.txt` (or `trainvalclasses.txt`). The default `--split reed` is
that class-disjoint split (150 train+val classes, 50 test: 8,855 / 2,933 images); `--split
standard` uses train_test_split.txt. Classes are matched by their number ("017."), since a few
class names are spelled differently in the two releases.
"""

from __future__ import annotations

from pathlib import Path

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Problems
from vldist.shards.convert.images import ImageSamples, add_feature_arguments, feature_options, image_plan

CUB_FILES = ("images.txt", "classes.txt", "image_class_labels.txt", "bounding_boxes.txt", "train_test_split.txt")


def _table(path: Path, columns: int) -> dict[int, list[str]]:
    """`<id> <field> ...` lines as id -> fields; BadInput names the line that does not parse."""
    if not path.is_file():
        raise BadInput(str(path), "is missing; --src must be the CUB_200_2011 folder")
    rows = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != columns or not fields[0].isdigit():
            raise BadInput(f"{path} line {number}", f"{line!r} is not '<id>' and {columns - 1} fields")
        rows[int(fields[0])] = fields[1:]
    return rows


def _class_number(class_dir: str) -> str:
    return class_dir.split(".", 1)[0]


class CubConverter(Converter):
    name = "cub"
    version = 1
    summary = "CUB-200-2011 images with Reed et al.'s 10 captions per image"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--text",
            type=Path,
            required=True,
            help="Reed et al.'s cvpr2016_cub folder (text_c10/ and the *classes.txt lists)",
        )
        parser.add_argument(
            "--split",
            choices=["reed", "standard"],
            default="reed",
            help="reed: class-disjoint train/val/test lists (default); standard: train_test_split.txt",
        )
        add_feature_arguments(parser, default_on=False)

    @classmethod
    def options(cls, args) -> dict:
        return {"split": args.split, "features": feature_options(args)}

    @classmethod
    def plan(cls, args, problems: Problems):
        src, text = Path(args.src), Path(args.text)
        images = _table(src / "images.txt", 2)
        labels = _table(src / "image_class_labels.txt", 2)
        boxes = _table(src / "bounding_boxes.txt", 5)
        standard = _table(src / "train_test_split.txt", 2)
        class_split = cls._reed_split(text) if args.split == "reed" else None
        text_dirs = {_class_number(p.name): p for p in (text / "text_c10").glob("*") if p.is_dir()}
        if not text_dirs:
            raise BadInput(str(text / "text_c10"), "holds no class folders; --text must be Reed's cvpr2016_cub folder")
        splits: dict[str, list[Item]] = {"train": [], "val": [], "test": []}
        for image_id, (name,) in sorted(images.items()):
            class_dir, file = name.split("/", 1) if "/" in name else ("", name)
            where = f"{src / 'images.txt'} image {image_id} ({name})"
            if class_split is not None:
                split = class_split.get(_class_number(class_dir))
                if split is None:
                    problems.report(where, f"class {class_dir} is in none of the class lists in {text}")
                    continue
            else:
                split = "train" if standard.get(image_id) == ["1"] else "test"
            caption_file = text_dirs.get(_class_number(class_dir), text / "text_c10" / class_dir) / (
                Path(file).stem + ".txt"
            )
            items = splits[split]
            key = f"{split}-{len(items):07d}"
            captions = cls._captions(caption_file)
            if not captions:
                problems.report(where, f"caption file {caption_file} is missing or empty", key=key, split=split)
                continue
            meta = {"image_id": image_id, "filename": name, "class_dir": class_dir}
            if image_id in labels:
                meta["class_id"] = int(labels[image_id][0])
            if image_id in boxes:
                x, y, w, h = (float(v) for v in boxes[image_id])
                meta["box"] = [x, y, x + w, y + h]
            items.append(Item(key, split, where, captions, {"images": {"": str(src / "images" / name)}, "meta": meta}))
        splits = {name: items for name, items in splits.items() if items}
        inputs = {"dataset": "CUB-200-2011", "files": {f: sha256_file(src / f) for f in CUB_FILES}}
        return image_plan(splits, inputs, args, problems.skipped)

    @staticmethod
    def _reed_split(text: Path) -> dict[str, str]:
        lists = {"train": "trainclasses.txt", "val": "valclasses.txt", "test": "testclasses.txt"}
        if not (text / lists["train"]).is_file() and (text / "trainvalclasses.txt").is_file():
            lists = {"train": "trainvalclasses.txt", "test": "testclasses.txt"}
        split_of = {}
        for split, file in lists.items():
            path = text / file
            if not path.is_file():
                raise BadInput(str(path), "is missing: --split reed needs Reed's class lists (or use --split standard)")
            for line in path.read_text(encoding="utf-8").split():
                split_of[_class_number(line)] = split
        return split_of

    @staticmethod
    def _captions(path: Path) -> list[str]:
        if not path.is_file():
            return []
        # Reed's files hold a few undecodable bytes; keep the text around them
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\ufffd", "")
        return [line.strip() for line in text.splitlines() if line.strip()]

    @classmethod
    def worker(cls, setup):
        return ImageSamples(setup)
