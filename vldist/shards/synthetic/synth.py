"""Builds the embedded synthetic dataset: rendered scenes, five captions each, region features.

The set is written into `<out>.partial/` and renamed to `<out>` only when complete
(embedded_set.building), so a build that was interrupted never looks finished.

Images and JSON depend only on the arguments. Features are float sums whose order depends on the
CPU and the torch thread count, so shards are byte-identical for the same seed on the same kind of
machine and thread count; elsewhere a few feature values may differ in their last float16 bit.
The extractor's standardisation is stored beside the manifest (feature_standardization.safetensors),
so features of new images can be computed like the set's (vldist/shards/features/extractor_setup.py).

`phrases="hard"` builds the harder phrase variant instead (hard_phrases.py: crowded, overlapping
scenes, objects of one kind named apart by relations), with the same schema, proposal count and
extractor; without it every byte is the standard set's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from vldist.data.vocab import Vocab
from vldist.shards.features.extractor import RegionFeatureExtractor
from vldist.shards.format.layout import STANDARDIZATION_NAME, VOCAB_NAME
from vldist.shards.format.standardization import save_standardization
from vldist.shards.format.writer import ShardSetWriter
from vldist.shards.synthetic.captions import make_captions
from vldist.shards.synthetic.embedded_set import SPLITS, building, check_counts, jpeg_bytes, sample_key, split_rng
from vldist.shards.synthetic.hard_phrases import (
    HARD_MAX_OBJECTS,
    HARD_STREAM_NAME,
    generate_hard_scene,
    make_hard_proposals,
)
from vldist.shards.synthetic.proposals import make_proposals
from vldist.shards.synthetic.scenes import Scene, SceneObject, generate_scene

STREAM_NAME = "vldist-synth"  # names the set's random streams: changing it changes every sample
MAX_REGIONS = 5  # the whole image plus at most 4 objects
PROPOSALS = 32  # candidate boxes per image for phrase localisation (proposals.py)
FEATURE_BATCH = 64
CALIBRATION_SCENES = 256  # scenes whose region features set the per-dimension standardisation
EXTRACTOR_SEED = 0  # fixed, not the data seed: sets built with other seeds share one extractor


@dataclass(frozen=True)
class PhraseVariant:
    """What a --phrases variant changes in the build; everything else is one code path."""

    stream: str  # names its random streams (scenes, captions, proposals)
    scene: Callable[[random.Random, int], Scene]
    proposals: Callable[..., list[list[int]]]  # make_proposals' arguments
    max_regions: int
    phrase: Callable[[SceneObject], str]  # an object's phrase in the JSON
    phrases_in_vocab: bool  # the train phrases' words join the captions' in vocab.json


PHRASE_VARIANTS = {  # --phrases: synth's scenes, or hard_phrases.py's
    "standard": PhraseVariant(STREAM_NAME, generate_scene, make_proposals, MAX_REGIONS, lambda o: o.phrase, False),
    "hard": PhraseVariant(
        HARD_STREAM_NAME, generate_hard_scene, make_hard_proposals, 1 + HARD_MAX_OBJECTS, lambda o: o.expression, True
    ),
}


def region_boxes(scene: Scene) -> list[list[int]]:
    """The stored "detector order": the whole image, then objects by area, largest first."""
    return [[0, 0, scene.width, scene.height]] + [list(o.box) for o in _by_area(scene)]


def _by_area(scene: Scene) -> list:
    return sorted(scene.objects, key=lambda o: -o.area)  # stable: ties keep scene order


def sample_metadata(
    key: str,
    split: str,
    scene: Scene,
    captions: list[str],
    seed: int = 0,
    proposals: int = PROPOSALS,
    phrases: str = "standard",
) -> dict:
    """The sample's JSON. Each object names its row in region_boxes ("region"); with `proposals`,
    `proposal_boxes` are drawn from a stream of their own per sample, so that adding them left
    every image and caption of the set as it was (`phrases="hard"`: hard_phrases.make_hard_proposals,
    from a stream of the hard variant's own)."""
    rows = {id(o): 1 + i for i, o in enumerate(_by_area(scene))}
    variant = PHRASE_VARIANTS[phrases]
    meta = {
        "id": key,
        "split": split,
        "width": scene.width,
        "height": scene.height,
        "captions": captions,
        "objects": [
            {
                "box": list(o.box),
                "phrase": variant.phrase(o),
                "shape": o.shape,
                "color": o.color,
                "size": o.size,
                "region": rows[id(o)],
            }
            for o in scene.objects
        ],
        "region_boxes": region_boxes(scene),
    }
    if proposals:
        rng = random.Random(f"{variant.stream}-proposals:{seed}:{key}")
        meta["proposal_boxes"] = variant.proposals(
            scene.width, scene.height, [list(o.box) for o in scene.objects], proposals, rng
        )
    return meta


def calibrated_extractor(
    backbone: str = "resnet50",
    weights: str | None = None,
    feature_size: int = 96,
    layer: str = "layer2",
    grid: int = 2,
    image_size: int = 128,
    device: str = "cpu",
) -> RegionFeatureExtractor:
    """The extractor of a synth set: seeded with EXTRACTOR_SEED and standardised on the regions of
    CALIBRATION_SCENES scenes of their own fixed stream (the same for every data seed). A set built
    before its statistics were stored gets them back from here (vldist/shards/features/extractor_setup.py)."""
    extractor = RegionFeatureExtractor(
        backbone, weights=weights, input_size=feature_size, seed=EXTRACTOR_SEED, layer=layer, grid=grid, device=device
    )
    calibration_rng = split_rng(STREAM_NAME, EXTRACTOR_SEED, "calibration")
    calibration = [generate_scene(calibration_rng, image_size) for _ in range(CALIBRATION_SCENES)]
    extractor.calibrate([s.image for s in calibration], [region_boxes(s) for s in calibration])
    return extractor


def build_synth(
    out_dir,
    n_train: int = 5000,
    n_val: int = 500,
    n_test: int = 1000,
    seed: int = 0,
    shard_size: int = 1000,
    image_size: int = 128,
    feature_size: int = 96,
    backbone: str = "resnet50",
    weights: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    layer: str = "layer2",
    grid: int = 2,
    proposals: int = PROPOSALS,
    phrases: str = "standard",
) -> dict:
    """Render, caption and featurise the synthetic splits into a shard set at `out_dir`.

    feature_size is the side the extractor resizes images to; layer and grid pick the ResNet stage
    and the roi_align grid (see features/extractor.py for why layer2 with a 2x2 grid is the default).
    `proposals`: candidate boxes per image for phrase localisation, with their features (0: none).
    `phrases`: "standard", or "hard" for the harder phrase variant (hard_phrases.py; the manifest's
    config then says `"phrases": "hard"`, and vocab.json also covers the train phrases).
    Returns the manifest.
    """
    if phrases not in PHRASE_VARIANTS:
        raise ValueError(f"phrases must be one of {tuple(PHRASE_VARIANTS)}, got {phrases!r}")
    variant = PHRASE_VARIANTS[phrases]
    counts = {"train": n_train, "val": n_val, "test": n_test}
    check_counts(counts)
    config = {
        "n_train": n_train,
        "n_val": n_val,
        "n_test": n_test,
        "seed": seed,
        "shard_size": shard_size,
        "image_size": image_size,
        "feature_size": feature_size,
        "backbone": backbone,
        "weights": weights,
        "layer": layer,
        "grid": grid,
        "proposals": proposals,
        **(
            {"phrases": phrases} if phrases != "standard" else {}
        ),  # absent from the standard set's: its manifest stays as it was
    }
    with building(out_dir, overwrite) as partial:  # refuses a taken --out before the costly calibration
        extractor = calibrated_extractor(backbone, weights, feature_size, layer, grid, image_size)
        features = {
            "extractor": backbone,
            "layer": layer,
            "grid": grid,
            "dim": extractor.dim,
            "weights": weights,
            "input_size": feature_size,
            "max_regions": variant.max_regions,
            "seed": EXTRACTOR_SEED,
            "standardized_on": f"{CALIBRATION_SCENES} calibration scenes (seed {EXTRACTOR_SEED})",
            "standardization": STANDARDIZATION_NAME,
            "proposals": proposals,
        }
        train_captions: list[str] = []
        with (
            tqdm(total=sum(counts.values()), unit="img", desc="synth", disable=not progress) as bar,
            ShardSetWriter(partial, shard_size=shard_size, source="synth") as writer,
        ):
            for split in SPLITS:
                rng = split_rng(variant.stream, seed, split)
                pending: list[tuple[Scene, dict]] = []
                for index in range(counts[split]):
                    scene = variant.scene(rng, image_size)
                    captions = make_captions(scene, rng)
                    if split == "train":
                        train_captions.extend(captions)
                        if variant.phrases_in_vocab:  # their words even where no caption says them
                            train_captions.extend(variant.phrase(o) for o in scene.objects)
                    meta = sample_metadata(sample_key(split, index), split, scene, captions, seed, proposals, phrases)
                    pending.append((scene, meta))
                    if len(pending) == FEATURE_BATCH or index == counts[split] - 1:
                        _write_batch(writer, split, pending, extractor)
                        bar.update(len(pending))
                        pending = []
            Vocab.build(train_captions).save(partial / VOCAB_NAME)
            save_standardization(partial, *extractor.standardization())
            manifest = writer.close(extra={"features": features, "config": config})
    return manifest


def _write_batch(
    writer: ShardSetWriter, split: str, pending: list[tuple[Scene, dict]], extractor: RegionFeatureExtractor
) -> None:
    scenes = [scene for scene, _ in pending]
    # one pass of the backbone for both: region rows first, then proposal rows
    boxes = [meta["region_boxes"] + meta.get("proposal_boxes", []) for _, meta in pending]
    rows = extractor.extract([s.image for s in scenes], boxes)
    for (scene, meta), feats in zip(pending, rows, strict=True):
        n = len(meta["region_boxes"])
        sample = {"__key__": meta["id"], "jpg": jpeg_bytes(scene), "json": meta, "regions.npy": feats[:n]}
        if "proposal_boxes" in meta:
            sample["proposals.npy"] = feats[n:]
        writer.write(split, sample)
