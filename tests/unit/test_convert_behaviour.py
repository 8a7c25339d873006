"""What every conversion promises: the same bytes for the same input, any worker count; its --out
protected; bad input reported by file and line, then stopped on or skipped and listed."""

import json

import numpy as np
import pytest
import torch
from dataset_fixtures import make_folder, make_karpathy, make_precomp
from helpers import read_shard_set

from vldist.shards.__main__ import main
from vldist.shards.format.verify import verify


def run(capsys, fmt, src, out, *extra):
    code = main(
        ["convert", fmt, "--src", str(src), "--out", str(out), "--quiet", "--shard-size", "3", *map(str, extra)]
    )
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def coco(tmp_path):
    make_karpathy(tmp_path / "coco", {"train": 7, "restval": 2, "val": 2, "test": 4})
    return tmp_path / "coco"


def test_same_bytes_with_one_worker_or_two(tmp_path, coco, capsys):
    features = ["--images", coco / "images", "--feature-size", "64", "--region-grid", "2"]
    threads = torch.get_num_threads()
    for workers in (1, 2):
        code, _ = run(
            capsys, "karpathy", coco / "dataset_coco.json", tmp_path / f"w{workers}", "--workers", workers, *features
        )
        assert code == 0
    one, two = files(tmp_path / "w1"), files(tmp_path / "w2")
    assert sorted(one) == sorted(two) and len(one) > 7
    assert one == two  # tars, manifest and vocab byte for byte
    assert torch.get_num_threads() == threads  # features ran on one thread; the caller's setting is back


def test_out_holds_one_conversion(tmp_path, coco, capsys):
    src, out = coco / "dataset_coco.json", tmp_path / "out"
    assert run(capsys, "karpathy", src, out, "--no-features", "--images", coco / "images")[0] == 0
    before = files(out)
    code, text = run(capsys, "karpathy", src, out, "--no-features", "--images", coco / "images")
    assert code == 0 and "already holds this conversion" in text and files(out) == before
    code, text = run(capsys, "karpathy", src, out, "--no-features", "--restval", "drop")
    assert code == 2 and "made from other input or options" in text and "--overwrite" in text
    assert (
        run(
            capsys,
            "karpathy",
            src,
            out,
            "--no-features",
            "--restval",
            "drop",
            "--overwrite",
            "--images",
            coco / "images",
        )[0]
        == 0
    )
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["samples"] == 7
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    code, text = run(capsys, "karpathy", src, tmp_path / "mine", "--no-features", "--overwrite")
    assert code == 2 and "notes.txt" in text and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_missing_image_stops_or_is_skipped_and_listed(tmp_path, coco, capsys):
    expected = make_karpathy(tmp_path / "again", {"train": 7, "test": 4})
    images = ["--images", tmp_path / "again" / "images"]
    missing = [e for e in expected if e["split"] == "test"][1]
    missing["path"].unlink()
    src = tmp_path / "again" / "dataset_coco.json"

    code, text = run(capsys, "karpathy", src, tmp_path / "stop", "--no-features", *images)
    assert code == 2
    assert f"images[{missing['entry']['imgid']}] ({missing['entry']['filename']})" in text
    assert f"image {missing['path']} does not exist" in text and "--on-error skip" in text
    assert not (tmp_path / "stop" / "manifest.json").exists()  # never a silent partial dataset

    code, text = run(capsys, "karpathy", src, tmp_path / "stop", "--no-features", *images, "--on-error", "skip")
    assert code == 0 and "1 skipped" in text and f"skipped: {src} images[{missing['entry']['imgid']}]" in text
    out = tmp_path / "stop"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["test"]["samples"] == 3 and manifest["conversion"]["skipped"] == {"test": 1}
    listed = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [(s["split"], s["key"]) for s in listed] == [("test", "test-0000001")]
    assert "does not exist" in listed[0]["problem"]
    assert verify(out).ok
    assert "test-0000001" not in [key for key, _ in read_shard_set(out)["test"]]


def test_unreadable_image_is_named(tmp_path, capsys):
    expected = make_folder(tmp_path / "data", "sidecar")
    expected[1]["path"].write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    code, text = run(capsys, "folder", tmp_path / "data", tmp_path / "out")
    assert code == 2 and f"image {expected[1]['path']} cannot be decoded" in text


def test_malformed_jsonl_line_is_named_by_line(tmp_path, capsys):
    make_folder(tmp_path / "data", "jsonl")
    index = tmp_path / "data" / "captions.jsonl"
    lines = index.read_text().splitlines()
    lines.insert(1, '{"image": "img/b.png", "captions": ["unterminated}')
    index.write_text("\n".join(lines) + "\n")

    code, text = run(capsys, "folder", tmp_path / "data", tmp_path / "out", "--index", "captions.jsonl")
    assert code == 2 and f"{index} line 2: is not valid JSON" in text
    code, text = run(
        capsys, "folder", tmp_path / "data", tmp_path / "out", "--index", "captions.jsonl", "--on-error", "skip"
    )
    assert code == 0 and f"skipped: {index} line 2: is not valid JSON" in text
    assert (
        sum(e["samples"] for e in json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"].values()) == 3
    )


def test_precomp_shape_that_does_not_match_the_captions_is_refused(tmp_path, capsys):
    make_precomp(tmp_path / "p", {"train": 4, "test": 3})
    ims = np.load(tmp_path / "p" / "test_ims.npy")
    np.save(tmp_path / "p" / "test_ims.npy", ims[:2])  # 2 images for 15 captions
    for policy in ("stop", "skip"):  # no image can be matched to its captions: never skippable
        code, text = run(capsys, "precomp", tmp_path / "p", tmp_path / "out", "--on-error", policy)
        assert code == 2
        assert (
            "test_ims.npy holds 2 rows but test_caps.txt has 15 lines; expected 5 captions per image (10 lines)" in text
        )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_malformed_karpathy_json_names_line_and_column(tmp_path, capsys):
    (tmp_path / "dataset_coco.json").write_text('{"images": [\n  {"split": "train",}\n]}')
    code, text = run(capsys, "karpathy", tmp_path / "dataset_coco.json", tmp_path / "out", "--no-features")
    assert code == 2 and "dataset_coco.json line 2 column 21: is not valid JSON" in text
