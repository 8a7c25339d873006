"""A job that trains on less of its shard set than the set holds says so once as training starts:
more regions per image than data.max_regions keeps (a folder converted with --features holds 36,
the `vsrn` demo job keeps 5), captions longer than data.max_caption_len (the manifest counts caption
words as a set is written). The `vsrn_folder` job fits a converted folder and trains on it."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from dataset_fixtures import make_scene_folder
from helpers import SMALL_VSRN, write_planted_shards

from vldist.data.fit_to_job import warn_what_the_job_leaves_out, what_the_job_leaves_out
from vldist.data.shardset import ShardSet
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config
from vldist.shards.__main__ import main as shards_main
from vldist.train import main as train_main
from vldist.train import usage


@pytest.fixture(scope="module")
def folder_set(tmp_path_factory):
    """A folder of rendered scenes, one caption each, converted with --features: 36 regions an image."""
    root = tmp_path_factory.mktemp("folder")
    make_scene_folder(root / "photos", {"train": 24, "val": 8, "test": 8})
    out = root / "shards"
    argv = ["convert", "folder", "--src", str(root / "photos"), "--out", str(out), "--features", "--quiet"]
    assert shards_main([*argv, "--feature-size", "48", "--backbone", "resnet18", "--workers", "1"]) == 0
    return out


def _leaves_out(job: str, shards, *overrides) -> list[str]:
    config = load_config(job, [f"data.shards={shards}", *overrides])
    return what_the_job_leaves_out(config, get_recipe(config.recipe)(config, vocab=None), ShardSet.open(shards))


def test_a_job_keeping_fewer_regions_than_the_set_holds_says_so_once(folder_set, caplog):
    assert json.loads((folder_set / "manifest.json").read_text())["features"]["max_regions"] == 36
    config = load_config("vsrn", [f"data.shards={folder_set}"])
    with caplog.at_level(logging.WARNING, logger="vldist.data"):
        warn_what_the_job_leaves_out(config, get_recipe("vsrn")(config, vocab=None), ShardSet.open(folder_set))
    assert [r.getMessage() for r in caplog.records] == [
        f"the shard set {folder_set} holds up to 36 regions per image and data.max_regions=5 keeps the first 5 "
        "(set data.max_regions=36 to use them all)"
    ]
    assert _leaves_out("vsrn", folder_set, "data.max_regions=36") == []
    assert _leaves_out("two_branch_embed", folder_set) == []  # it pools every region: nothing left out


def test_the_folder_job_keeps_every_region_and_trains_on_a_converted_folder(folder_set, tmp_path, capsys):
    assert "vsrn_folder" in usage("vsrn")
    assert load_config("vsrn_folder", []).data.max_regions == 36
    assert _leaves_out("vsrn_folder", folder_set) == []
    code = train_main(
        [
            "vsrn_folder",
            f"data.shards={folder_set}",
            f"output.dir={tmp_path / 'run'}",
            *SMALL_VSRN,
            "data.batch_size=8",
            "data.workers=0",
            "train.epochs=1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["test"]["n_images"] == 8 and metrics["skipped_samples"] == 0


def test_captions_longer_than_max_caption_len_are_counted_and_said(tmp_path):
    shards = write_planted_shards(tmp_path / "set", {"train": 40, "val": 8, "test": 8}, shard_size=20)
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["splits"]["train"]["caption_words"] == {"3": 200}  # 5 captions of 3 words an image
    assert "caption_words" not in manifest["splits"]["train"]["shards"][0]
    assert _leaves_out("vsrn", shards, "data.max_caption_len=4") == [
        f"200 of the 200 train captions of the shard set {shards} (100.0%) have more than the 2 words "
        "data.max_caption_len=4 keeps (<start> and <end> count too), and lose the words past them (the longest "
        "has 3: set data.max_caption_len=5 to keep every one whole)"
    ]
    assert _leaves_out("vsrn", shards, "data.max_caption_len=5") == []
    # a set written before manifests counted caption words: unknown, nothing said
    older = tmp_path / "older"
    shutil.copytree(shards, older)
    for split in manifest["splits"].values():
        del split["caption_words"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert _leaves_out("vsrn", older, "data.max_caption_len=4") == []
