"""Two training streams taking turns (what L2C needs: single-image captions and image pairs).

A test-only VSRN variant reads the planted train split (200 samples) and val split (40) as two
streams; with a global batch of 32 that is 7 + 2 steps an epoch, alternating while both last.
"""

import json

import pytest

import vldist.recipes
from vldist.data.streams import StreamSource
from vldist.recipes.jobs import load_config
from vldist.recipes.vsrn import VSRNRecipe
from vldist.training.on_each_rank import run

SMALL = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "eval.baseline=false",
    "data.workers=1",
    "train.validate_every=0",
]


class TwoStreamVSRN(VSRNRecipe):
    seen: list[str] = []

    @classmethod
    def train_streams(cls, config):
        return {"captions": "train", "pairs": "val"}

    def forward_inputs(self, batch, update="main"):
        TwoStreamVSRN.seen.append(batch["stream"])
        return super().forward_inputs(batch, update)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_streams_take_turns_step_by_step_until_each_has_had_its_epoch(
    planted_shards, tmp_path, monkeypatch, accumulation
):
    monkeypatch.setitem(vldist.recipes.RECIPES, "vsrn", TwoStreamVSRN)
    TwoStreamVSRN.seen = []
    config = load_config(
        "vsrn",
        [
            f"data.shards={planted_shards}",
            f"output.dir={tmp_path}",
            "train.epochs=2",
            f"train.grad_accumulation={accumulation}",
            *SMALL,
        ],
    )
    results = run(config)
    one_epoch = ["captions", "pairs", "captions", "pairs", *["captions"] * 5]
    per_step = TwoStreamVSRN.seen[::accumulation]
    assert per_step == one_epoch * 2
    assert TwoStreamVSRN.seen == [
        s for s in one_epoch * 2 for _ in range(accumulation)
    ]  # a step's micro-batches share a stream
    assert results["steps"] == 18
    assert json.loads((tmp_path / "metrics.json").read_text())["samples_seen"] == 2 * (7 + 2) * 32


def test_exact_epochs_refuse_several_streams(planted_shards, tmp_path, monkeypatch):
    monkeypatch.setitem(vldist.recipes.RECIPES, "vsrn", TwoStreamVSRN)
    config = load_config(
        "vsrn", [f"data.shards={planted_shards}", f"output.dir={tmp_path}", "data.resampled=false", *SMALL]
    )
    with pytest.raises(ValueError, match="data.resampled=false reads one stream; this recipe has 2"):
        run(config)


class PacedStreamVSRN(TwoStreamVSRN):
    """The second stream reads another shard set (here a copy), 8 a step, one step per step of the first."""

    other_shards = ""

    @classmethod
    def train_streams(cls, config):
        return {
            "captions": "train",
            "pairs": StreamSource("val", shards=cls.other_shards, batch_size=8, steps_like="captions"),
        }


def test_a_stream_from_another_shard_set_with_its_own_batch_paced_by_the_first(planted_shards, tmp_path, monkeypatch):
    import shutil

    from vldist.errors import ShardsNotFoundError

    other = tmp_path / "other"
    monkeypatch.setitem(vldist.recipes.RECIPES, "vsrn", PacedStreamVSRN)
    monkeypatch.setattr(PacedStreamVSRN, "other_shards", str(other))
    config = load_config(
        "vsrn", [f"data.shards={planted_shards}", f"output.dir={tmp_path / 'run'}", "train.epochs=1", *SMALL]
    )
    with pytest.raises(ShardsNotFoundError, match=str(other)):  # the second stream reads the other set
        run(config)
    shutil.copytree(planted_shards, other)
    TwoStreamVSRN.seen = []
    results = run(config)
    assert TwoStreamVSRN.seen == ["captions", "pairs"] * 7  # 200 train samples / 32 = 7 steps, and 7 of val
    assert results["steps"] == 14
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["samples_seen"] == 7 * 32 + 7 * 8
