"""`python -m vldist.caption`: a user's own images get features like the shard set's, then captions.

The extractor is rebuilt from what a shard set stores (manifest features + the standardisation
file, or synth's own calibration for a synth set built before the file existed), so an image of the
set gets the features the set stores for it; the CLI then captions images as recipe.caption does.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dataset_fixtures import make_scene_folder
from helpers import write_planted_shards
from PIL import Image

from vldist import caption as caption_cli
from vldist.errors import ShardsUnfitError
from vldist.shards.__main__ import main as shards_main
from vldist.shards.features.extractor_setup import extractor_for
from vldist.shards.format.layout import STANDARDIZATION_NAME
from vldist.shards.format.standardization import load_standardization
from vldist.shards.format.verify import verify
from vldist.shards.format.writer import ShardSetWriter
from vldist.shards.synthetic.captions import make_captions
from vldist.shards.synthetic.embedded_set import jpeg_bytes, split_rng
from vldist.shards.synthetic.scenes import generate_scene
from vldist.shards.synthetic.synth import STREAM_NAME, build_synth


def _samples(out: Path, split: str) -> list[tuple[str, dict]]:
    """(key, {ext: bytes}) of a split, in key order."""
    samples: dict[str, dict] = {}
    for shard in json.loads((out / "manifest.json").read_text())["splits"][split]["shards"]:
        with tarfile.open(out / shard["file"]) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return sorted(samples.items())


def _regions(members: dict) -> np.ndarray:
    return np.load(io.BytesIO(members["regions.npy"]))


def _within_float16_rounding(got: np.ndarray, want: np.ndarray) -> None:
    """Float sums in another order (another batch) may round a value to its float16 neighbour."""
    assert got.dtype == want.dtype == np.float16 and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-9, atol=2**-10)


def _write_manifest(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def synth_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("caption") / "synth"
    build_synth(out, n_train=40, n_val=8, n_test=8, progress=False)
    return out


@pytest.fixture(scope="module")
def folder_set(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("folder")
    make_scene_folder(root / "photos", {"train": 40, "val": 4, "test": 4})
    out = root / "shards"
    assert (
        shards_main(
            [
                "convert",
                "folder",
                "--src",
                str(root / "photos"),
                "--out",
                str(out),
                "--features",
                "--feature-size",
                "48",
                "--region-grid",
                "2",
                "--quiet",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    return root / "photos", out


# ------------------------------------------------------------------ the extractor of a shard set


def test_synth_features_rebuilt_from_the_set_are_the_stored_ones(synth_set):
    manifest = json.loads((synth_set / "manifest.json").read_text())
    assert manifest["features"]["standardization"] == STANDARDIZATION_NAME
    assert (synth_set / STANDARDIZATION_NAME).is_file() and verify(synth_set).ok
    features = extractor_for(synth_set)
    samples = _samples(synth_set, "val")
    metas = [json.loads(members["json"]) for _, members in samples]

    # synth featurises each scene as rendered, before its JPEG is encoded: re-render the val scenes
    rng, scenes = split_rng(STREAM_NAME, 0, "val"), []
    for _ in samples:
        scenes.append(generate_scene(rng, 128))
        make_captions(scenes[-1], rng)
    assert [jpeg_bytes(scene) for scene in scenes] == [members["jpg"] for _, members in samples]
    # in one batch, as build_synth featurised them (8 scenes, one FEATURE_BATCH): bit for bit
    batch = features.extractor.extract([s.image for s in scenes], [m["region_boxes"] for m in metas])
    for got, (_, members) in zip(batch, samples, strict=True):
        assert np.array_equal(got, _regions(members))
    # one image at a time, as the CLI computes them: to float16 rounding
    for scene, meta, (_, members) in zip(scenes, metas, samples, strict=True):
        _within_float16_rounding(
            features.extractor.extract([scene.image], [meta["region_boxes"]])[0], _regions(members)
        )

    # the stored JPEG is a lossy copy of that render: close to the stored rows, not equal
    jpeg = Image.open(io.BytesIO(samples[0][1]["jpg"]))
    from_jpeg = features.extractor.extract([jpeg.convert("RGB")], [metas[0]["region_boxes"]])[0]
    stored = _regions(samples[0][1]).astype(np.float32)
    assert np.corrcoef(from_jpeg.astype(np.float32).ravel(), stored.ravel())[0, 1] > 0.97

    # a user's image has no object boxes: the whole image plus a 2x2 grid
    assert features.boxes(128, 96) == [
        [0, 0, 128, 96],
        [0, 0, 64, 48],
        [64, 0, 128, 48],
        [0, 48, 64, 96],
        [64, 48, 128, 96],
    ]
    rows = features([jpeg])[0]
    assert rows.shape == (5, 2048) and np.array_equal(rows[0], from_jpeg[0])  # the same whole-image box


def test_a_synth_set_built_before_the_statistics_were_stored_gets_them_back(synth_set, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(synth_set, old)
    shift, scale = load_standardization(old / STANDARDIZATION_NAME, 2048)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / STANDARDIZATION_NAME).unlink()
    del manifest["features"]["standardization"]
    _write_manifest(old, manifest)  # as build_synth wrote it before this file existed
    assert verify(old).ok

    rebuilt_shift, rebuilt_scale = extractor_for(old).extractor.standardization()
    assert np.array_equal(rebuilt_shift, shift) and np.array_equal(rebuilt_scale, scale)

    # a manifest naming a file that is gone is a damaged set: verify and the extractor say so
    manifest["features"]["standardization"] = STANDARDIZATION_NAME
    _write_manifest(old, manifest)
    assert any(STANDARDIZATION_NAME in p and "missing" in p for p in verify(old).problems)
    with pytest.raises(ShardsUnfitError, match=f"{STANDARDIZATION_NAME}.*missing"):
        extractor_for(old)


def test_folder_set_features_rebuilt_from_the_set_are_the_stored_ones(folder_set, tmp_path):
    photos, out = folder_set
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["features"]["standardization"] == STANDARDIZATION_NAME
    assert (out / STANDARDIZATION_NAME).is_file() and verify(out).ok
    features = extractor_for(out)
    samples = _samples(out, "val")
    # the user's own files, read as the CLI reads them
    images = [caption_cli.read_image(str(photos / json.loads(m["json"])["filename"])) for _, m in samples]
    for image, (_, members) in zip(images, samples, strict=True):
        assert features.boxes(image.width, image.height) == json.loads(members["json"])["region_boxes"]
    # in one batch, as the converter featurised them (4 items, one call of its sample maker): bit for bit
    for got, (_, members) in zip(features(images), samples, strict=True):
        assert np.array_equal(got, _regions(members))
    for image, (_, members) in zip(images, samples, strict=True):  # one at a time, as the CLI
        _within_float16_rounding(features([image])[0], _regions(members))

    # converted before the file was stored: no way to recompute, a clear error saying what to do
    older = tmp_path / "older"
    older.mkdir()
    del manifest["features"]["standardization"]
    _write_manifest(older, manifest)
    with pytest.raises(ShardsUnfitError, match="no stored feature standardisation.*convert it again"):
        extractor_for(older)


def test_sets_whose_features_cannot_be_computed_say_why(tmp_path):
    planted = write_planted_shards(tmp_path / "planted", counts={"train": 4, "val": 2, "test": 2})
    with pytest.raises(ShardsUnfitError, match="outside vldist's own extractor"):
        extractor_for(planted)
    with ShardSetWriter(tmp_path / "bare", source="folder") as writer:
        writer.write("train", {"__key__": "a", "json": {"captions": ["a red circle"]}})
    with pytest.raises(ShardsUnfitError, match="has no region features"):
        extractor_for(tmp_path / "bare")


# ------------------------------------------------------------------------------ the command line


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def captioner_run(synth_set, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("captioner") / "run"
    proc = _cli(
        "vldist.train",
        "captioner",
        f"data.shards={synth_set}",
        f"output.dir={run}",
        "train.max_steps=3",
        "model.hidden=16",
        "model.embed=16",
        "data.batch_size=8",
        "data.eval_batch_size=16",
        "eval.baseline=false",
        "eval.self_retrieval_pool=8",
        "eval.meteor=false",  # its JVM's ~6 s start: this run is only the model the CLI captions with
        "train.validate_every=0",
        "metrics.enabled=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _expected(run: Path, paths: list[Path], beam_sizes: list[int | None]) -> list[list[str]]:
    """recipe.caption on features computed in-process through the CLI's own path, once per beam
    size (None: the run's own eval.beam_size)."""
    config, recipe, model, shard_set = caption_cli.load_checkpoint(run, None, "cpu")
    features = extractor_for(shard_set)
    regions = [features([caption_cli.read_image(str(p))])[0] for p in paths]
    results = []
    for beam_size in beam_sizes:
        if beam_size is not None:
            config.eval.beam_size = beam_size
        captions = recipe.caption(model, regions, torch.device("cpu"))
        for caption in captions:  # words of the model's vocabulary ("<unk>" is written "unk")
            assert all(w in recipe.vocab.stoi or w == "unk" for w in caption.split()), caption
        results.append(captions)
    return results


def test_the_cli_captions_a_users_images_and_names_the_ones_it_cannot_read(captioner_run, synth_set, tmp_path):
    a = tmp_path / "a.jpg"  # an image of the set
    a.write_bytes(_samples(synth_set, "test")[0][1]["jpg"])
    b = tmp_path / "b.png"  # a new one, not square, with an alpha channel
    generate_scene(random.Random(7), 96).image.resize((120, 90)).convert("RGBA").save(b)

    default_beam, greedy = _expected(captioner_run, [a, b], [None, 1])
    proc = _cli("vldist.caption", captioner_run, a, b)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [path for path, _ in lines] == [str(a), str(b)]
    assert [caption for _, caption in lines] == default_beam

    missing, not_an_image = tmp_path / "missing.png", tmp_path / "notes.jpg"
    not_an_image.write_text("these are notes, not an image\n")
    proc = _cli("vldist.caption", captioner_run, missing, a, not_an_image, "--beam-size", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and str(missing) in errors[0] and str(not_an_image) in errors[1], proc.stderr
    assert proc.stdout.splitlines() == [f"{a}\t{greedy[0]}"]  # the readable one is still captioned


def test_the_cli_refuses_recipes_without_captions_and_missing_checkpoints(tmp_path, monkeypatch, capsys):
    image = tmp_path / "x.png"
    Image.new("RGB", (32, 24), "red").save(image)
    assert caption_cli.main([str(tmp_path / "no-run"), str(image)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err

    monkeypatch.setattr(
        caption_cli, "load_checkpoint", lambda *args: (SimpleNamespace(recipe="vsrn"), SimpleNamespace(), None, None)
    )
    assert caption_cli.main([str(tmp_path), str(image)]) == 2
    assert capsys.readouterr().err.startswith("error: recipe vsrn does not generate captions")
