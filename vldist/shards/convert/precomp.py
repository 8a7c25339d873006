"""`precomp`: the precomputed bottom-up features of SCAN, VSE++ and VSRN (coco_precomp, f30k_precomp).

For each split: `{split}_ims.npy`, float32 (N, 36, 2048), one row of regions per image in detector
order, and `{split}_caps.txt`, one caption per line, captions 5i..5i+4 describing image i.
Optional: `{split}_ids.txt` (one source id per image, or per caption) and `{split}_ims_bbx.npy`
(N, 36, 4) region boxes. Some releases repeat each image row once per caption (VSE++'s "im_div"
case: as many rows as captions); then rows 5i..5i+4 are image i. Splits: train, dev (written as
`val`), test and, for COCO, testall (the 5K test set). The .npy files are memory-mapped: a worker
reads only its rows, so a 30 GB file never has to fit in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vldist.file_integrity import sha256_file
from vldist.shards.convert.base import BadInput, Converter, Item, Plan, Problems

KNOWN_SPLITS = ("train", "dev", "test", "testall")
RENAMED = {"dev": "val"}
FLOAT16_MAX = 65504.0


def _mapped(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise BadInput(str(path), f"is not a readable .npy array ({err})") from None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise BadInput(str(path), f"is not UTF-8 text ({err})") from None


class PrecompConverter(Converter):
    name = "precomp"
    version = 1
    summary = "SCAN/VSE++/VSRN precomputed bottom-up features ({split}_ims.npy + {split}_caps.txt)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--splits",
            default=None,
            help="comma-separated source splits (default: every {split}_caps.txt with its "
            "{split}_ims.npy, e.g. train,dev,test,testall)",
        )
        parser.add_argument("--captions-per-image", type=int, default=5, help="captions per image (default 5)")
        parser.add_argument(
            "--dtype",
            choices=["float16", "float32"],
            default="float16",
            help="stored feature type (default float16: half the size; float32 keeps the values exactly)",
        )

    @classmethod
    def options(cls, args) -> dict:
        return {"splits": args.splits, "captions_per_image": args.captions_per_image, "dtype": args.dtype}

    @classmethod
    def plan(cls, args, problems: Problems) -> Plan:
        src = Path(args.src)
        if not src.is_dir():
            raise BadInput(
                str(src), "is not a directory; --src is the folder holding {split}_ims.npy and {split}_caps.txt"
            )
        names = (
            args.splits.split(",")
            if args.splits
            else sorted(
                (p.name.removesuffix("_caps.txt") for p in src.glob("*_caps.txt")),
                key=lambda s: (KNOWN_SPLITS.index(s) if s in KNOWN_SPLITS else len(KNOWN_SPLITS), s),
            )
        )
        if not names:
            raise BadInput(str(src), "holds no {split}_caps.txt files; is it a coco_precomp or f30k_precomp folder?")
        cpi = args.captions_per_image
        splits, inputs, shapes = {}, {"files": {}}, set()
        for name in names:
            split = RENAMED.get(name, name)
            items, files = cls._split(src, name, split, cpi, problems)
            splits[split] = items
            inputs["files"].update(files)
            shapes.add(tuple(items[0].data["shape"][1:]) if items else None)
        shapes.discard(None)
        if len(shapes) > 1:
            raise BadInput(str(src), f"splits have different feature shapes {sorted(shapes)}; convert them separately")
        regions, dim = shapes.pop() if shapes else (None, None)
        features = {
            "extractor": "precomputed",
            "dim": dim,
            "regions": "as given",
            "max_regions": regions,
            "dtype": args.dtype,
        }
        return Plan(splits, inputs, features=features, prepare=lambda: {"dtype": args.dtype}, skipped=problems.skipped)

    @classmethod
    def _split(cls, src: Path, name: str, split: str, cpi: int, problems: Problems):
        ims_path, caps_path = src / f"{name}_ims.npy", src / f"{name}_caps.txt"
        for path in (ims_path, caps_path):
            if not path.is_file():
                raise BadInput(str(path), f"is missing: split {name!r} needs {ims_path.name} and {caps_path.name}")
        ims, captions = _mapped(ims_path), _lines(caps_path)
        if ims.ndim != 3:
            raise BadInput(str(ims_path), f"has shape {ims.shape}; expected (images, regions, features)")
        rows = ims.shape[0]
        if len(captions) == cpi * rows:
            step = 1  # one row per image
        elif len(captions) == rows and rows % cpi == 0 and rows:
            step = cpi  # one row per caption: image i is row cpi*i (its repeats are not read)
            if not np.array_equal(ims[0], ims[cpi - 1]):
                raise BadInput(
                    str(ims_path),
                    f"has one row per caption ({rows}) but rows 0 and {cpi - 1} differ, "
                    "so they are not repeats of one image; check the files",
                )
        else:
            raise BadInput(
                f"{ims_path} and {caps_path.name}",
                f"{ims_path.name} holds {rows} rows but {caps_path.name} has {len(captions)} lines; expected "
                f"{cpi} captions per image ({cpi * rows} lines), or one row per caption. "
                "Is one of the files truncated, or from another split?",
            )
        images = rows // step
        ids = cls._optional_lines(src / f"{name}_ids.txt", images, step)
        boxes_path = src / f"{name}_ims_bbx.npy"
        boxes = _mapped(boxes_path) if boxes_path.is_file() else None
        if boxes is not None and (boxes.ndim != 3 or boxes.shape[0] != rows or boxes.shape[1:] != (ims.shape[1], 4)):
            raise BadInput(
                str(boxes_path),
                f"has shape {boxes.shape}; expected ({rows}, {ims.shape[1]}, 4) to match {ims_path.name}",
            )
        files = {
            p.name: sha256_file(p) for p in (ims_path, caps_path, src / f"{name}_ids.txt", boxes_path) if p.is_file()
        }
        items = []
        for i in range(images):
            texts = [c.strip() for c in captions[i * cpi : (i + 1) * cpi]]
            where = f"{ims_path} row {i * step} ({caps_path.name} lines {i * cpi + 1}-{(i + 1) * cpi})"
            key = f"{split}-{i:07d}"
            if not all(texts):
                problems.report(where, "has an empty caption line", key=key, split=split)
                continue
            data = {"ims": str(ims_path), "row": i * step, "shape": list(ims.shape), "source_split": name, "index": i}
            if boxes is not None:
                data["boxes"] = str(boxes_path)
            if ids is not None:
                data["source_id"] = ids[i]
            items.append(Item(key, split, where, texts, data))
        return items, files

    @staticmethod
    def _optional_lines(path: Path, images: int, step: int) -> list[str] | None:
        if not path.is_file():
            return None
        lines = [line.strip() for line in _lines(path)]
        if len(lines) == images:
            return lines
        if len(lines) == images * 5:  # one id per caption
            return lines[::5]
        if len(lines) == images * step:
            return lines[::step]
        raise BadInput(str(path), f"has {len(lines)} lines; expected one id per image ({images}) or per caption")

    @classmethod
    def worker(cls, setup):
        return PrecompSamples(setup["dtype"])


class PrecompSamples:
    def __init__(self, dtype: str):
        self.dtype = np.dtype(dtype)
        self._open: dict[str, np.ndarray] = {}  # memory maps, opened once per worker

    def _array(self, path: str) -> np.ndarray:
        if path not in self._open:
            self._open[path] = np.load(path, mmap_mode="r", allow_pickle=False)
        return self._open[path]

    def __call__(self, items: list[Item]) -> list:
        return [self._sample(item) for item in items]

    def _sample(self, item: Item):
        regions = np.asarray(self._array(item.data["ims"])[item.data["row"]], dtype=np.float32)
        if not np.isfinite(regions).all():
            return BadInput(item.where, "region features hold NaN or inf")
        if self.dtype == np.float16 and np.abs(regions).max() > FLOAT16_MAX:
            return BadInput(
                item.where,
                f"a feature value exceeds float16's range ({np.abs(regions).max():.4g}); convert with --dtype float32",
            )
        meta = {
            "id": item.key,
            "split": item.split,
            "source_split": item.data["source_split"],
            "index": item.data["index"],
            "captions": item.captions,
        }
        if "source_id" in item.data:
            meta["source_id"] = item.data["source_id"]
        if "boxes" in item.data:
            meta["region_boxes"] = (
                np.asarray(self._array(item.data["boxes"])[item.data["row"]], dtype=np.float64).round(2).tolist()
            )
        return {"json": meta, "regions.npy": regions.astype(self.dtype)}
