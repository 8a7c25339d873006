"""Image members and CNN region features for the converters that read image files.

Images are stored as the source's own bytes when they are JPEG or PNG (no re-encoding, no loss);
other formats are re-encoded as JPEG. Each image is decoded once, in full, so an unreadable file
is found at conversion time and not mid-training.

Region features (optional) come from vldist's RegionFeatureExtractor over a grid of boxes: without
a detector, a G x G grid of cells is the usual stand-in for bottom-up regions (G=6 gives VSRN's
36 regions). Every dimension is standardised with statistics of the first train images, as synth
does (the engine stores them beside the manifest: feature_standardization.safetensors); features are
computed on one torch thread per worker so they do not depend on --workers.
"""

from __future__ import annotations

import argparse
import copy
import io
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vldist.shards.convert.base import BadInput, Item, Plan
from vldist.shards.features.extractor_args import add_extractor_arguments

STORED_AS_IS = {"JPEG": "jpg", "PNG": "png"}
REENCODE_QUALITY = 95
CALIBRATION_IMAGES = 256
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass
class LoadedImage:
    ext: str  # member extension: "jpg" or "png"
    data: bytes
    image: object  # the decoded PIL image, RGB
    width: int
    height: int


def load_image(path: str | Path, where: str) -> LoadedImage:
    """Read and fully decode one image; BadInput names the file and what is wrong."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.exists():
        raise BadInput(where, f"image {path} does not exist; check the image root (--images / --src)")
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as opened:
            kind = opened.format
            image = opened.convert("RGB")  # forces a full decode
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise BadInput(where, f"image {path} cannot be decoded ({type(err).__name__}: {err})") from None
    ext = STORED_AS_IS.get(kind)
    if ext is None:  # webp, bmp, gif...: stored as JPEG so every reader can decode it
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=REENCODE_QUALITY)
        ext, data = "jpg", buf.getvalue()
    return LoadedImage(ext, data, image, image.width, image.height)


def grid_boxes(width: int, height: int, cells: int) -> list[list[int]]:
    """A cells x cells grid over the image as pixel boxes [x0, y0, x1, y1], row by row."""
    xs = [round(width * i / cells) for i in range(cells + 1)]
    ys = [round(height * i / cells) for i in range(cells + 1)]
    return [[xs[c], ys[r], xs[c + 1], ys[r + 1]] for r in range(cells) for c in range(cells)]


# ------------------------------------------------------------------------- feature options


def add_feature_arguments(parser: argparse.ArgumentParser, default_on: bool = True) -> None:
    group = parser.add_argument_group("region features (CNN over a grid of boxes)")
    group.add_argument(
        "--features",
        dest="features",
        action="store_true",
        default=default_on,
        help="store regions.npy per image" + (" (default)" if default_on else ""),
    )
    group.add_argument(
        "--no-features",
        dest="features",
        action="store_false",
        help="store images and text only" + ("" if default_on else " (default)"),
    )
    group.add_argument(
        "--region-grid",
        type=int,
        default=6,
        help="regions are the cells of a G x G grid (default 6: 36 regions, as VSRN)",
    )
    add_extractor_arguments(group, input_size=224)
    group.add_argument("--device", default="cpu", help="where features are computed: cpu or cuda (default cpu)")


def feature_options(args: argparse.Namespace) -> dict | None:
    if not args.features:
        return None
    if args.region_grid < 1:
        raise ValueError(f"--region-grid must be at least 1, got {args.region_grid}")
    return {
        "backbone": args.backbone,
        "weights": args.weights,
        "layer": args.layer,
        "grid": args.grid,
        "input_size": args.feature_size,
        "region_grid": args.region_grid,
    }


def manifest_features(options: dict | None, dim: int | None, extra: dict | None = None) -> dict | None:
    """manifest["features"]; `extra` adds or overrides entries (a converter whose items carry
    extra_boxes or proposal_boxes says so here: "regions", "max_regions", "proposals")."""
    if options is None:
        return None
    return {
        "extractor": options["backbone"],
        "weights": options["weights"],
        "layer": options["layer"],
        "grid": options["grid"],
        "input_size": options["input_size"],
        "dim": dim,
        "regions": "grid",
        "region_grid": options["region_grid"],
        "max_regions": options["region_grid"] ** 2,
        "standardized_on": f"the first {CALIBRATION_IMAGES} readable train images",
        **(extra or {}),
    }


@contextmanager
def one_thread():
    """Torch on one thread inside the block, restored after: the same float sums whatever
    --workers is (deterministic features), and a caller's own thread setting left alone."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _extractor(options: dict, device: str):
    from vldist.shards.features.extractor import RegionFeatureExtractor

    return RegionFeatureExtractor(
        options["backbone"],
        weights=options["weights"],
        input_size=options["input_size"],
        layer=options["layer"],
        grid=options["grid"],
        device=device,
    )


def feature_dim(options: dict | None) -> int | None:
    """The row width the options give, without building the whole network."""
    if options is None:
        return None
    channels = {"layer1": 256, "layer2": 512, "layer3": 1024, "layer4": 2048}[options["layer"]]
    if options["backbone"] in ("resnet18", "resnet34"):
        channels //= 4
    return channels * options["grid"] ** 2


def calibrated_setup(options: dict | None, device: str, paths: list[Path]) -> dict | None:
    """Feature settings plus the standardisation statistics of the first readable train images:
    computed once in the main process and handed to every worker."""
    if options is None:
        return None
    extractor = _extractor(options, device)
    images, first_problem = [], None
    for path in paths:
        try:
            images.append(load_image(path, str(path)).image)
        except BadInput as bad:
            first_problem = first_problem or bad  # each is reported when its shard is written
            continue
        if len(images) == CALIBRATION_IMAGES:
            break
    if not images:
        raise BadInput(
            "region features",
            f"none of the first {len(paths)} train images can be read to calibrate "
            f"them on; the first: {first_problem.what}",
        )
    with one_thread():
        extractor.calibrate(images, [grid_boxes(im.width, im.height, options["region_grid"]) for im in images])
    shift, scale = extractor.standardization()
    return {"options": options, "device": device, "shift": shift, "scale": scale}


class RegionFeatures:
    """In a worker: the extractor rebuilt from the setup, with the main process's statistics."""

    def __init__(self, setup: dict):
        self.cells = setup["options"]["region_grid"]
        self.extractor = _extractor(setup["options"], setup["device"])
        self.extractor.set_standardization(setup["shift"], setup["scale"])

    def boxes(self, image: LoadedImage) -> list[list[int]]:
        return grid_boxes(image.width, image.height, self.cells)

    def __call__(self, images: list[LoadedImage], extra: list[list] | None = None) -> list:
        """Rows of each image's grid boxes, then of its `extra` boxes: one backbone pass for all."""
        extra = extra or [[] for _ in images]
        with one_thread():
            return self.extractor.extract(
                [im.image for im in images], [self.boxes(im) + more for im, more in zip(images, extra, strict=True)]
            )


@dataclass
class _Featurised:
    """One image of a sample, waiting for its feature rows."""

    sample: dict
    prefix: str  # member prefix: "" or "img1."
    about: dict  # the JSON object describing the image
    image: LoadedImage
    extra: list  # boxes appended to the grid as region rows
    proposals: list  # boxes whose rows become proposals.npy


class ImageSamples:
    """The sample maker of the image formats. An item's data holds `images` (member name ->
    path; "" is the sample's one image, stored as `jpg`/`png`; a name such as "img1" gives
    `img1.jpg` and `img1.regions.npy`) and `meta`, merged into the sample's JSON.

    Optional, each keyed by image name like `images` (plain JSON, as items are fingerprinted):
    `sizes` ([width, height] the annotation was made on: an image of another size is bad input,
    since its boxes would be misplaced), `extra_boxes` (pixel boxes appended after the grid
    boxes as region rows, so an annotated object has its own row) and `proposal_boxes` (written
    to the JSON and, with features, as `proposals.npy`, rows aligned). Region and proposal rows
    of an image come from one backbone pass."""

    def __init__(self, setup: dict | None):
        self.features = RegionFeatures(setup) if setup else None

    def __call__(self, items) -> list:
        results, loaded = [], []
        for item in items:
            try:
                images = {name: load_image(path, item.where) for name, path in item.data["images"].items()}
                _check_sizes(item, images)
            except BadInput as bad:
                results.append(bad)
                continue
            meta = {
                "id": item.key,
                "split": item.split,
                **copy.deepcopy(item.data.get("meta", {})),
                "captions": item.captions,
            }
            sample = {"json": meta}
            for name, image in images.items():
                prefix = f"{name}." if name else ""
                sample[prefix + image.ext] = image.data
                about = meta.setdefault(name, {}) if name else meta
                about.update(width=image.width, height=image.height)
                proposals = item.data.get("proposal_boxes", {}).get(name, [])
                if proposals:
                    about["proposal_boxes"] = proposals
                loaded.append(
                    _Featurised(sample, prefix, about, image, item.data.get("extra_boxes", {}).get(name, []), proposals)
                )
            results.append(sample)
        if self.features and loaded:
            rows = self.features([x.image for x in loaded], [x.extra + x.proposals for x in loaded])
            for entry, feats in zip(loaded, rows, strict=True):
                regions = self.features.boxes(entry.image) + entry.extra
                entry.about["region_boxes"] = regions
                entry.sample[entry.prefix + "regions.npy"] = feats[: len(regions)]
                if entry.proposals:
                    entry.sample[entry.prefix + "proposals.npy"] = feats[len(regions) :]
        return results


def _check_sizes(item: Item, images: dict[str, LoadedImage]) -> None:
    for name, (width, height) in item.data.get("sizes", {}).items():
        image = images[name]
        if (image.width, image.height) != (width, height):
            raise BadInput(
                item.where,
                f"image {item.data['images'][name]} is {image.width} x {image.height} pixels "
                f"but its annotation was made on {width} x {height}; is --images the "
                "dataset's own image folder (not resized copies)?",
            )


def image_plan(
    splits: dict[str, list[Item]],
    inputs: dict,
    args: argparse.Namespace,
    skipped: list[dict],
    features_extra: dict | None = None,
) -> Plan:
    """The Plan of an image format: features (if asked for) are calibrated on the first train
    images, and only when some shard is still to be written. `features_extra`: manifest_features."""
    options = feature_options(args)
    first = splits.get("train") or [item for items in splits.values() for item in items]
    train_paths = [Path(p) for item in first[: 2 * CALIBRATION_IMAGES] for p in item.data["images"].values()]
    return Plan(
        splits,
        inputs,
        features=manifest_features(options, feature_dim(options), features_extra),
        prepare=lambda: calibrated_setup(options, args.device, train_paths),
        skipped=skipped,
    )
