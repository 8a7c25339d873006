"""Region features of a user's own images, computed as a shard set's were (`python -m vldist.caption`).

A model trained on a shard set has only ever seen that set's features: one RegionFeatureExtractor
(backbone, weights, stage, grid, input size, seed) and one per-dimension standardisation. Both are
read back from the set: the extractor's settings from `manifest.json`'s `features` entry, the
standardisation from the file it names (`features.standardization`). A synth set built before the
file was stored gets its statistics recomputed exactly as build_synth made them (the same seed, the
same calibration scenes); other sets without the file cannot be served and say how to rebuild them.

Region boxes of a user's image:
- converted image sets (`regions: "grid"`): the same G x G grid the converter used
  (`features.region_grid`), so a set's own image gives exactly its stored features;
- synth sets: training saw the whole image plus up to 4 object boxes, but a user's image has no
  object boxes, so it gets the whole image plus a 2 x 2 grid (5 regions, synth's max_regions).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vldist.data.shardset import ShardSet
from vldist.errors import ShardsUnfitError
from vldist.shards.convert.images import grid_boxes, one_thread
from vldist.shards.format.layout import STANDARDIZATION_NAME
from vldist.shards.format.standardization import load_standardization

SYNTH_USER_GRID = 2  # a user's image on a synth model: the whole image plus this grid's cells
SYNTH_REGIONS = "the whole image plus a 2x2 grid (5 regions; synth's own samples use object boxes)"


@dataclass
class ImageFeatures:
    """A ready extractor and the rule giving a user image's region boxes."""

    extractor: object  # RegionFeatureExtractor, standardised as the shard set's features are
    boxes: Callable[[int, int], list[list[int]]]  # (width, height) -> pixel boxes [x0, y0, x1, y1]
    regions: str  # the box rule in words
    single_thread: bool = False  # converters compute features on one torch thread: the same sums here

    def __call__(self, images: list) -> list[np.ndarray]:
        """One float16 (R, F) array per PIL image (converted to RGB first)."""
        images = [im.convert("RGB") for im in images]
        with one_thread() if self.single_thread else nullcontext():
            return self.extractor.extract(images, [self.boxes(im.width, im.height) for im in images])


def _synth_boxes(width: int, height: int) -> list[list[int]]:
    return [[0, 0, width, height]] + grid_boxes(width, height, SYNTH_USER_GRID)


def extractor_for(shard_set: ShardSet | str | Path, device: str = "cpu") -> ImageFeatures:
    """The extractor of `shard_set`'s features, standardised as they were, with its box rule.
    Raises ShardsUnfitError saying what is missing when features cannot be computed like the set's."""
    if not isinstance(shard_set, ShardSet):
        shard_set = ShardSet.open(shard_set)
    where, manifest = shard_set.directory, shard_set.manifest
    features = manifest.get("features") or {}
    if features.get("dim") is None:
        raise ShardsUnfitError(
            f"the shard set {where} has no region features (its manifest.json has no features.dim), so "
            "there is no feature extractor to compute a new image's features with; use a set built with "
            "features (synth, or `python -m vldist.shards convert ... --features`)"
        )
    source = manifest.get("source")
    if source == "synth":
        boxes, regions, single_thread = _synth_boxes, SYNTH_REGIONS, False
    elif features.get("regions") == "grid" and features.get("region_grid"):
        cells = int(features["region_grid"])
        boxes = lambda width, height: grid_boxes(width, height, cells)  # noqa: E731
        regions, single_thread = f"a {cells}x{cells} grid, as the converter used", True
    else:
        raise ShardsUnfitError(
            f"the features of {where} come from {features.get('extractor', 'an unknown extractor')} over "
            f"{features.get('regions', 'unknown')} regions, outside vldist's own extractor; features of a new "
            "image cannot be computed like them here"
        )
    name = features.get("standardization")
    if name:
        if not (Path(where) / name).is_file():
            raise ShardsUnfitError(
                f"{Path(where) / name} (the feature standardisation manifest.json names) is "
                "missing; rebuild the shard set to restore it"
            )
        extractor = _build(features, device, where)
        try:
            shift, scale = load_standardization(Path(where) / name, features["dim"])
        except (OSError, ValueError) as err:
            raise ShardsUnfitError(f"{err}; rebuild the shard set to restore it") from None
        extractor.set_standardization(shift, scale)
    elif source == "synth":
        extractor = _build(features, device, where, _recalibrated_synth(manifest.get("config") or {}))
    else:
        raise ShardsUnfitError(
            f"the shard set {where} has no stored feature standardisation (no {STANDARDIZATION_NAME}; it was "
            "converted before vldist stored one), so a new image's features cannot be made to match its "
            "features; convert it again (the same `python -m vldist.shards convert` command with --overwrite)"
        )
    return ImageFeatures(extractor, boxes, regions, single_thread)


def _build(features: dict, device: str, where, make=None):
    """The extractor the manifest describes (built by `make(settings, device, where)` when given)."""
    from vldist.shards.features.extractor import RegionFeatureExtractor

    settings = {
        "backbone": features.get("extractor", "resnet50"),
        "weights": features.get("weights"),
        "input_size": features.get("input_size", 96),
        "layer": features.get("layer", "layer2"),
        "grid": features.get("grid", 2),
        "seed": features.get("seed", 0),
    }
    try:
        if make is not None:
            extractor = make(settings, device, where)
        else:
            extractor = RegionFeatureExtractor(
                settings["backbone"],
                weights=settings["weights"],
                input_size=settings["input_size"],
                seed=settings["seed"],
                device=device,
                layer=settings["layer"],
                grid=settings["grid"],
            )
    except ShardsUnfitError:
        raise
    except (ValueError, RuntimeError) as err:
        raise ShardsUnfitError(f"cannot rebuild the feature extractor of {where}: {err}") from None
    if extractor.dim != features["dim"]:
        raise ShardsUnfitError(
            f"the feature extractor of {where} as its manifest.json describes it gives "
            f"{extractor.dim} features, but the manifest says {features['dim']}"
        )
    return extractor


def _recalibrated_synth(config: dict):
    """For a synth set built before the statistics were stored: build_synth's own calibration again
    (its seed, its calibration scenes at the set's image size)."""
    from vldist.shards.synthetic.synth import EXTRACTOR_SEED, calibrated_extractor

    def make(settings: dict, device: str, where):
        if settings["seed"] != EXTRACTOR_SEED:
            raise ShardsUnfitError(
                f"the synth set {where} records extractor seed {settings['seed']}, not "
                f"{EXTRACTOR_SEED}; rebuild it with `python -m vldist.shards synth --overwrite`"
            )
        return calibrated_extractor(
            settings["backbone"],
            settings["weights"],
            settings["input_size"],
            settings["layer"],
            settings["grid"],
            image_size=config.get("image_size", 128),
            device=device,
        )

    return make
