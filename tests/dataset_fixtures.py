"""Miniature copies of public dataset layouts, made by the tests (the real sets cannot be
downloaded here). Each follows its dataset's real file names and formats; each returns what a
correct conversion must reproduce, in source order.

Karpathy images are rendered synth scenes with their own captions and precomp features carry a
planted signal, so a model trained on their conversions has something real to learn.
"""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

import numpy as np
from helpers import planted_sample
from PIL import Image

from vldist.shards.synthetic.captions import make_captions
from vldist.shards.synthetic.scenes import generate_scene


def _tokens(text: str) -> list[str]:
    return text.lower().replace(".", "").split()


def image_bytes(seed: int, size=(40, 32), fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def make_karpathy(
    root: Path, counts: dict[str, int], dataset: str = "coco", image_size: int = 64, seed: int = 0
) -> list[dict]:
    """`dataset_<name>.json` and its image folders; returns the images in file order with
    `split`, `path` and `captions` (the raw sentences, stripped)."""
    rng = random.Random(seed)
    splits = [s for s, n in counts.items() for _ in range(n)]
    rng.shuffle(splits)  # the real file interleaves splits
    images, expected, sentid = [], [], 0
    for imgid, split in enumerate(splits):
        scene = generate_scene(rng, image_size)
        captions = make_captions(scene, rng, n=6 if imgid % 4 == 0 else 5)  # some COCO images have 6
        raws = [c[0].upper() + c[1:] + ("." if imgid % 2 else " ") for c in captions]
        entry = {
            "split": split,
            "imgid": imgid,
            "sentids": list(range(sentid, sentid + len(raws))),
            "sentences": [
                {"raw": r, "tokens": _tokens(r), "imgid": imgid, "sentid": sentid + k} for k, r in enumerate(raws)
            ],
        }
        sentid += len(raws)
        if dataset == "coco":
            folder = "val2014" if split in ("val", "test", "restval") else "train2014"
            cocoid = 100000 + 7 * imgid
            entry.update(filepath=folder, filename=f"COCO_{folder}_{cocoid:012d}.jpg", cocoid=cocoid)
            path = root / "images" / folder / entry["filename"]
        else:
            entry["filename"] = f"{1000092795 + imgid}.jpg"
            path = root / "images" / entry["filename"]
        path.parent.mkdir(parents=True, exist_ok=True)
        scene.image.save(path, format="JPEG", quality=90)
        images.append(entry)
        expected.append({"split": split, "path": path, "captions": [r.strip() for r in raws], "entry": entry})
    (root / f"dataset_{dataset}.json").write_text(json.dumps({"images": images, "dataset": dataset}))
    return expected


def make_precomp(
    root: Path,
    counts: dict[str, int],
    regions: int = 4,
    dim: int = 16,
    per_caption: bool = False,
    ids: bool = True,
    boxes: bool = True,
    seed: int = 0,
) -> dict[str, dict]:
    """`{split}_ims.npy`, `{split}_caps.txt` and optional `{split}_ids.txt`, `{split}_ims_bbx.npy`.
    Images are planted samples (helpers.planted_sample). Returns per source split the features
    (one row per image), captions (5 per image) and ids."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    expected = {}
    for split, n in counts.items():
        planted = [planted_sample(rng, regions, dim) for _ in range(n)]
        ims = np.stack([feats for feats, _ in planted]) if planted else np.zeros((0, regions, dim), np.float32)
        captions = [c for _, texts in planted for c in texts]
        ids_list = [str(500000 + 3 * i) for i in range(n)]
        bbx = rng.uniform(0, 400, (n, regions, 4)).astype(np.float32)
        rows = np.repeat(ims, 5, axis=0) if per_caption else ims
        np.save(root / f"{split}_ims.npy", rows)
        (root / f"{split}_caps.txt").write_text("\n".join(captions) + "\n")
        if ids:
            (root / f"{split}_ids.txt").write_text("\n".join(ids_list) + "\n")
        if boxes:
            np.save(root / f"{split}_ims_bbx.npy", np.repeat(bbx, 5, axis=0) if per_caption else bbx)
        expected[split] = {
            "ims": ims,
            "captions": [captions[5 * i : 5 * i + 5] for i in range(n)],
            "ids": ids_list,
            "boxes": bbx,
        }
    return expected


def make_cub(root: Path, per_class: int = 3) -> dict:
    """CUB_200_2011/ (images.txt, classes.txt, image_class_labels.txt, bounding_boxes.txt,
    train_test_split.txt, images/) and cvpr2016_cub/ (text_c10/, *classes.txt). Four classes:
    two train, one val, one test in Reed's lists. Class 003's text folder is spelled differently
    (as a few are in the real release)."""
    cub, text = root / "CUB_200_2011", root / "cvpr2016_cub"
    classes = ["001.Black_footed_Albatross", "002.Laysan_Albatross", "003.Brewer_Blackbird", "004.Groove_billed_Ani"]
    text_names = {"003.Brewer_Blackbird": "003.Brewers_Blackbird"}
    lines = {name: [] for name in ("images", "labels", "boxes", "split")}
    expected = []
    image_id = 0
    for c, class_dir in enumerate(classes, 1):
        (cub / "images" / class_dir).mkdir(parents=True)
        (text / "text_c10" / text_names.get(class_dir, class_dir)).mkdir(parents=True)
        for k in range(per_class):
            image_id += 1
            stem = f"{class_dir.split('.')[1]}_00{k}_{image_id}"
            (cub / "images" / class_dir / f"{stem}.jpg").write_bytes(image_bytes(image_id))
            captions = [
                f"this bird {k} of class {c} has a {w} crown"
                for w in ("red", "blue", "grey", "white", "black", "brown", "long", "short", "sharp", "flat")
            ]
            caption_file = text / "text_c10" / text_names.get(class_dir, class_dir) / f"{stem}.txt"
            caption_file.write_text("\n".join(captions) + "\n")
            lines["images"].append(f"{image_id} {class_dir}/{stem}.jpg")
            lines["labels"].append(f"{image_id} {c}")
            lines["boxes"].append(f"{image_id} {2.0 + k} 3.0 20.0 15.0")
            lines["split"].append(f"{image_id} {k % 2}")
            expected.append(
                {
                    "image_id": image_id,
                    "class_dir": class_dir,
                    "captions": captions,
                    "path": cub / "images" / class_dir / f"{stem}.jpg",
                    "box": [2.0 + k, 3.0, 22.0 + k, 18.0],
                    "standard": "train" if k % 2 else "test",
                    "reed": ["train", "train", "val", "test"][c - 1],
                    "class_id": c,
                }
            )
    for name, file in (
        ("images", "images.txt"),
        ("labels", "image_class_labels.txt"),
        ("boxes", "bounding_boxes.txt"),
        ("split", "train_test_split.txt"),
    ):
        (cub / file).write_text("\n".join(lines[name]) + "\n")
    (cub / "classes.txt").write_text("\n".join(f"{i} {c}" for i, c in enumerate(classes, 1)) + "\n")
    for file, names in (
        ("trainclasses.txt", classes[:2]),
        ("valclasses.txt", classes[2:3]),
        ("testclasses.txt", classes[3:]),
    ):
        (text / file).write_text("\n".join(text_names.get(n, n) for n in names) + "\n")
    return {"cub": cub, "text": text, "images": expected}


B2W_COLUMNS = [
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
]


def make_birds_to_words(root: Path, pairs: int = 5, seed: int = 0) -> dict:
    """`birds-to-words-v1.0.tsv` (header, one row per description, rows of a pair not adjacent)
    and `images/<photo id>.jpg`. Returns the pairs in order of first appearance."""
    rng = random.Random(seed)
    images = root / "images"
    images.mkdir(parents=True)
    rows, expected = [], []
    for p in range(pairs):
        photo1, photo2 = 3000000 + 2 * p, 3000000 + 2 * p + 1
        for photo in (photo1, photo2):
            (images / f"{photo}.jpg").write_bytes(image_bytes(photo))
        split = ["train", "train", "val", "test", "train"][p % 5]
        descriptions = [
            f"animal1 has a {w} beak than animal2 in pair {p}"
            for w in ("longer", "darker", "thinner", "brighter", "shorter")
        ][: 3 + p % 3]
        for ann, text in enumerate(descriptions, 1):
            rows.append(
                [
                    f"https://www.inaturalist.org/observations/{90 + photo1}",
                    f"https://static.inaturalist.org/photos/{photo1}/medium.jpg",
                    "Larus occidentalis",
                    "base",
                    f"https://www.inaturalist.org/observations/{90 + photo2}",
                    f"https://static.inaturalist.org/photos/{photo2}/medium.jpg",
                    "Larus californicus",
                    "sameGenus",
                    split,
                    str(ann),
                    text,
                ]
            )
        expected.append(
            {
                "split": split,
                "descriptions": descriptions,
                "paths": (images / f"{photo1}.jpg", images / f"{photo2}.jpg"),
            }
        )
    first_rows = [r for r in rows if r[9] == "1"]  # keep each pair's first row in pair order
    rest = [r for r in rows if r[9] != "1"]
    rng.shuffle(rest)
    with open(root / "birds-to-words-v1.0.tsv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(B2W_COLUMNS)
        writer.writerows(first_rows + rest)
    return {"tsv": root / "birds-to-words-v1.0.tsv", "images": images, "pairs": expected}


def make_folder(root: Path, mode: str = "sidecar") -> list[dict]:
    """Images in train/ and val/ (sidecar mode: `<name>.txt` beside each) or a flat folder with a
    CSV or JSONL index. Returns the images with their split and captions in converter order."""
    root.mkdir(parents=True)
    expected = []
    layout = (
        [("train/a.jpg", "train"), ("train/b.png", "train"), ("val/c.jpg", "val")]
        if mode == "sidecar"
        else [("img/a.jpg", "train"), ("img/b.png", "train"), ("img/c.jpg", "test")]
    )
    for n, (name, split) in enumerate(layout):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image_bytes(n, fmt="PNG" if name.endswith(".png") else "JPEG"))
        expected.append(
            {
                "image": name,
                "split": split,
                "path": path,
                "captions": [f"picture {n} caption {k}" for k in range(2 + n)],
            }
        )
    if mode == "sidecar":
        for e in expected:
            e["path"].with_suffix(".txt").write_text("\n".join(e["captions"]) + "\n\n")
    elif mode == "csv":
        with open(root / "captions.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["image", "caption", "split"])
            for k in range(max(len(e["captions"]) for e in expected)):  # an image's rows are interleaved
                writer.writerows([e["image"], e["captions"][k], e["split"]] for e in expected if k < len(e["captions"]))
    else:
        with open(root / "captions.jsonl", "w") as f:
            for e in expected:
                f.write(json.dumps({"image": e["image"], "captions": e["captions"], "split": e["split"]}) + "\n")
    return sorted(expected, key=lambda e: (e["split"], e["image"])) if mode == "sidecar" else expected


def make_scene_folder(root: Path, counts: dict[str, int], image_size: int = 64, seed: int = 0) -> None:
    """Conceptual Captions' layout, as most people's own data looks: one image, one description
    (a sidecar `.txt`), in train/ val/ test/ folders. Rendered scenes, so there is something to learn."""
    rng = random.Random(seed)
    for split, n in counts.items():
        (root / split).mkdir(parents=True)
        for i in range(n):
            scene = generate_scene(rng, image_size)
            scene.image.save(root / split / f"{i:05d}.jpg", format="JPEG", quality=90)
            (root / split / f"{i:05d}.txt").write_text(make_captions(scene, rng, n=1)[0] + "\n")
