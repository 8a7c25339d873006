"""Shards written by other tools, following shards/README.md, train as they are: no manifest,
no vocab.json; `webdataset.ShardWriter` for train, plain `tarfile` for val and test."""

import json

import numpy as np
import webdataset as wds
from helpers import npy_bytes, planted_sample, write_tar

from vldist.recipes.jobs import load_config
from vldist.training.on_each_rank import run


def _sample(rng, key):
    feats, captions = planted_sample(rng, dim=16)
    return key, {"captions": captions}, feats


def test_shards_from_webdataset_and_tarfile_train(tmp_path):
    rng = np.random.default_rng(0)
    out = tmp_path / "foreign"
    out.mkdir()
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=40) as sink:
        for i in range(96):
            key, meta, feats = _sample(rng, f"tr{i:05d}")
            sink.write({"__key__": key, "json": json.dumps(meta).encode(), "regions.npy": npy_bytes(feats)})
    for split, n in (("val", 20), ("test", 20)):
        members = {}
        for i in range(n):
            key, meta, feats = _sample(rng, f"{split}{i:05d}")
            members.update({f"{key}.json": json.dumps(meta).encode(), f"{key}.regions.npy": npy_bytes(feats)})
        write_tar(out / f"{split}-000000.tar", members)
    assert not (out / "manifest.json").exists() and len(list(out.glob("train-*.tar"))) == 3

    config = load_config(
        "vsrn",
        [
            f"data.shards={out}",
            f"output.dir={tmp_path / 'run'}",
            "data.batch_size=32",
            "model.embed_size=32",
            "model.word_dim=16",
            "model.decoder_hidden=32",
            "data.eval_batch_size=20",
            "data.shuffle_buffer=50",
            "train.epochs=2",
            "eval.baseline=false",
            "data.workers=0",
            "metrics.enabled=false",
        ],
    )
    results = run(config)
    assert results["steps"] == 2 * 3  # 96 samples counted from the tar headers: 3 steps of 32 an epoch
    assert results["test"]["n_images"] == 20
    assert (tmp_path / "run" / "vocab.json").is_file()  # built from the train captions
