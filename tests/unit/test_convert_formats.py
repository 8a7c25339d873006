"""Each converter on a miniature of its dataset's real layout: converted, verified, read back sample by sample."""

import json

import numpy as np
import pytest
from dataset_fixtures import make_birds_to_words, make_cub, make_folder, make_karpathy, make_precomp
from helpers import npy_load, read_shard_set

from vldist.shards.__main__ import main
from vldist.shards.format.verify import verify

FAST_FEATURES = ["--feature-size", "64", "--region-grid", "2"]


def convert(fmt, src, out, *extra, workers=1):
    code = main(
        [
            "convert",
            fmt,
            "--src",
            str(src),
            "--out",
            str(out),
            "--quiet",
            "--workers",
            str(workers),
            "--shard-size",
            "4",
            *map(str, extra),
        ]
    )
    assert code == 0
    assert verify(out).ok, verify(out).problems
    return json.loads((out / "manifest.json").read_text()), read_shard_set(out)


def test_karpathy_coco_restval_joins_train_in_file_order(tmp_path):
    expected = make_karpathy(tmp_path / "coco", {"train": 6, "restval": 3, "val": 2, "test": 3})
    manifest, samples = convert(
        "karpathy",
        tmp_path / "coco" / "dataset_coco.json",
        tmp_path / "out",
        "--images",
        tmp_path / "coco" / "images",
        *FAST_FEATURES,
    )

    assert {s: e["samples"] for s, e in manifest["splits"].items()} == {"train": 9, "val": 2, "test": 3}
    assert manifest["source"] == "karpathy" and manifest["conversion"]["inputs"]["dataset"] == "coco"
    assert manifest["features"]["dim"] == 2048 and manifest["features"]["max_regions"] == 4
    for split, source_splits in (("train", ("train", "restval")), ("val", ("val",)), ("test", ("test",))):
        wanted = [e for e in expected if e["split"] in source_splits]
        assert [key for key, _ in samples[split]] == [f"{split}-{i:07d}" for i in range(len(wanted))]
        for (_key, members), source in zip(samples[split], wanted, strict=True):
            meta = json.loads(members["json"])
            assert meta["captions"] == source["captions"][:5]  # first five sentences, as VSE++
            assert meta["cocoid"] == source["entry"]["cocoid"] and meta["source_split"] == source["split"]
            assert members["jpg"] == source["path"].read_bytes()  # the original bytes
            regions = npy_load(members["regions.npy"])
            assert regions.shape == (4, 2048) and regions.dtype == np.float16
            assert meta["region_boxes"] == [[0, 0, 32, 32], [32, 0, 64, 32], [0, 32, 32, 64], [32, 32, 64, 64]]
    assert (tmp_path / "out" / "vocab.json").is_file() and not (tmp_path / "out" / ".convert").exists()


def test_karpathy_flickr_reads_images_by_filename_and_restval_options(tmp_path):
    expected = make_karpathy(tmp_path / "f30k", {"train": 3, "restval": 2, "test": 2}, dataset="flickr30k")
    src = tmp_path / "f30k" / "dataset_flickr30k.json"
    manifest, samples = convert(
        "karpathy",
        src,
        tmp_path / "keep",
        "--images",
        tmp_path / "f30k" / "images",
        "--no-features",
        "--restval",
        "keep",
        "--captions-per-image",
        "0",
    )
    assert {s: e["samples"] for s, e in manifest["splits"].items()} == {"train": 3, "restval": 2, "test": 2}
    assert "features" not in manifest
    test = [e for e in expected if e["split"] == "test"]
    for (_, members), source in zip(samples["test"], test, strict=True):
        assert json.loads(members["json"])["captions"] == source["captions"]  # 0: every sentence
        assert "regions.npy" not in members
    manifest, _ = convert(
        "karpathy",
        src,
        tmp_path / "drop",
        "--images",
        tmp_path / "f30k" / "images",
        "--no-features",
        "--restval",
        "drop",
    )
    assert manifest["splits"]["train"]["samples"] == 3 and "restval" not in manifest["splits"]


@pytest.mark.parametrize("per_caption", [False, True], ids=["row-per-image", "row-per-caption"])
def test_precomp_keeps_features_ids_and_boxes(tmp_path, per_caption):
    expected = make_precomp(tmp_path / "f30k_precomp", {"train": 6, "dev": 3, "test": 5}, per_caption=per_caption)
    manifest, samples = convert("precomp", tmp_path / "f30k_precomp", tmp_path / "out", "--dtype", "float32")

    assert {s: e["samples"] for s, e in manifest["splits"].items()} == {"train": 6, "val": 3, "test": 5}
    assert manifest["features"] == {
        "extractor": "precomputed",
        "dim": 16,
        "regions": "as given",
        "max_regions": 4,
        "dtype": "float32",
    }
    for split, source in (("train", "train"), ("val", "dev"), ("test", "test")):
        for i, (_key, members) in enumerate(samples[split]):
            meta = json.loads(members["json"])
            assert meta["captions"] == expected[source]["captions"][i]
            assert meta["source_id"] == expected[source]["ids"][i] and meta["source_split"] == source
            np.testing.assert_array_equal(npy_load(members["regions.npy"]), expected[source]["ims"][i])
            np.testing.assert_allclose(meta["region_boxes"], expected[source]["boxes"][i], atol=0.005)


def test_precomp_float16_by_default(tmp_path):
    expected = make_precomp(tmp_path / "p", {"test": 3}, ids=False, boxes=False)
    manifest, samples = convert("precomp", tmp_path / "p", tmp_path / "out")
    regions = npy_load(samples["test"][0][1]["regions.npy"])
    assert regions.dtype == np.float16 and manifest["features"]["dtype"] == "float16"
    np.testing.assert_allclose(regions, expected["test"]["ims"][0], rtol=1e-3, atol=1e-3)
    assert "source_id" not in json.loads(samples["test"][0][1]["json"])


@pytest.mark.parametrize("split", ["reed", "standard"])
def test_cub_captions_boxes_and_splits(tmp_path, split):
    fixture = make_cub(tmp_path)
    manifest, samples = convert("cub", fixture["cub"], tmp_path / "out", "--text", fixture["text"], "--split", split)
    by_split = {}
    for image in fixture["images"]:
        by_split.setdefault(image[split], []).append(image)
    assert {s: e["samples"] for s, e in manifest["splits"].items()} == {s: len(v) for s, v in by_split.items()}
    for name, images in by_split.items():
        for (_, members), image in zip(samples[name], images, strict=True):
            meta = json.loads(members["json"])
            assert meta["captions"] == image["captions"] and len(meta["captions"]) == 10
            assert meta["box"] == image["box"] and meta["class_id"] == image["class_id"]
            assert members["jpg"] == image["path"].read_bytes()
    assert manifest["conversion"]["inputs"]["dataset"] == "CUB-200-2011"


def test_birds_to_words_pairs_hold_both_images_and_ordered_descriptions(tmp_path):
    fixture = make_birds_to_words(tmp_path / "b2w")
    manifest, samples = convert(
        "birds_to_words", fixture["tsv"], tmp_path / "out", "--images", fixture["images"], "--features", *FAST_FEATURES
    )
    counts = {}
    for pair in fixture["pairs"]:
        counts[pair["split"]] = counts.get(pair["split"], 0) + 1
    assert {s: e["samples"] for s, e in manifest["splits"].items()} == counts
    for split in counts:
        pairs = [p for p in fixture["pairs"] if p["split"] == split]
        for (_, members), pair in zip(samples[split], pairs, strict=True):
            meta = json.loads(members["json"])
            assert meta["captions"] == pair["descriptions"]  # annN order, rows regrouped
            assert members["img1.jpg"] == pair["paths"][0].read_bytes()
            assert members["img2.jpg"] == pair["paths"][1].read_bytes()
            assert meta["img1"]["species"] == "Larus occidentalis" and meta["img2"]["selection"] == "sameGenus"
            assert npy_load(members["img2.regions.npy"]).shape == (4, 2048)
            assert len(meta["img1"]["region_boxes"]) == 4


@pytest.mark.parametrize("mode", ["sidecar", "csv", "jsonl"])
def test_folder_sidecars_csv_and_jsonl(tmp_path, mode):
    expected = make_folder(tmp_path / "data", mode)
    index = {"sidecar": [], "csv": ["--index", "captions.csv"], "jsonl": ["--index", "captions.jsonl"]}[mode]
    manifest, samples = convert("folder", tmp_path / "data", tmp_path / "out", *index)
    for split in manifest["splits"]:
        images = [e for e in expected if e["split"] == split]
        assert [json.loads(m["json"])["filename"] for _, m in samples[split]] == [e["image"] for e in images]
        for (_, members), image in zip(samples[split], images, strict=True):
            assert json.loads(members["json"])["captions"] == image["captions"]
            ext = "png" if image["image"].endswith(".png") else "jpg"
            assert members[ext] == image["path"].read_bytes()
    assert sum(e["samples"] for e in manifest["splits"].values()) == len(expected)
