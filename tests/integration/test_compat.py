"""Checkpoints against the job that loads them (vldist/compat.py), through the commands: one of
another model or feature width is refused saying what differs, and one of vldist 0.1.0 is upgraded
and evaluates and resumes as it did then (docs/bad-input.md, Checkpoints)."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_VSRN, assert_same_weights, train_vsrn, weights, write_planted_shards

from vldist import compat
from vldist.checkpoint import verify
from vldist.evaluate import main as evaluate_main

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "vldist-0.1.0"
# the settings the 0.1.0 fixture was trained with (its README)
OLD_JOB = ["model.embed_size=32", "model.decoder_hidden=32", "model.word_dim=16", "model.rrr_layers=1",
           "data.batch_size=32", "data.shuffle_buffer=50", "data.eval_batch_size=64", "train.epochs=2",
           "eval.baseline=false", "metrics.enabled=false"]


def test_resuming_with_another_model_config_names_the_keys_that_differ(planted_shards, trained_vsrn, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_vsrn, run)
    code, err = train_vsrn(capsys, f"data.shards={planted_shards}", f"output.dir={run}", "train.epochs=2",
                           "train.resume=latest", *SMALL_VSRN, "model.embed_size=48", "model.rrr_layers=2")
    assert code == 2
    assert f"cannot resume from {run / 'checkpoints' / 'step-00000007'}" in err
    assert "model.embed_size: checkpoint 32, this job 48" in err and "model.rrr_layers: checkpoint 4, this job 2" in err
    assert "size mismatch" not in err and "another output.dir" in err
    verify(run / "checkpoints" / "step-00000007")  # nothing lost


def test_shards_of_another_feature_width_are_refused_on_resume_and_in_evaluation(trained_vsrn, tmp_path, capsys):
    wide = write_planted_shards(tmp_path / "wide", dim=48)
    run = tmp_path / "run"
    shutil.copytree(trained_vsrn, run)
    code, err = train_vsrn(capsys, f"data.shards={wide}", f"output.dir={run}", "train.epochs=2", "train.resume=latest",
                           *SMALL_VSRN)
    assert code == 2 and "region feature width: checkpoint 32 (trained on" in err and f"shards 48 ({wide})" in err
    code = evaluate_main([str(run), "--shards", str(wide)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot evaluate" in err and "region feature width: checkpoint 32" in err


def test_a_checkpoint_of_vldist_0_1_evaluates_and_resumes_as_it_did_then(planted_shards, tmp_path, capsys):
    """0.1.0 named the region projection `fc` and had model.captions_per_image; its checkpoint
    still loads: evaluation gives what 0.1.0 measured, and resuming ends with 0.1.0's own weights."""
    expected = json.loads((OLD / "expected" / "metrics.json").read_text())
    checkpoint = OLD / "step-00000007"
    assert evaluate_main([str(checkpoint), "--shards", str(planted_shards), "--split", "val", "--json"]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("{"):])
    for key, value in expected["history"][0]["val"].items():  # 0.1.0's validation of this very checkpoint
        assert printed["full"][key] == pytest.approx(value, abs=1e-9), key

    run = tmp_path / "run"
    code, err = train_vsrn(capsys, f"data.shards={planted_shards}", f"output.dir={run}", f"train.resume={checkpoint}",
                           *OLD_JOB)
    assert code == 0, err
    renamed = compat.upgrade_state(_load(OLD / "expected" / "model-step-00000014.safetensors"), {"recipe": "vsrn"})
    assert "image.region_projection.weight" in renamed  # stored as image.fc.weight
    resumed = weights(run / "checkpoints" / "step-00000014")
    # 0.1.0 ran on the torch of its day; torch 2.15 rounds some kernels differently (measured:
    # every tensor within 2e-7). w_r's bias feeds a BatchNorm, which subtracts it again: its
    # gradient is rounding noise that Adam scales to whole steps, so it (and the running mean it
    # shifts) follows the rounding of the torch at hand (measured gaps 4e-3 and 7e-4).
    noise = ("image.rrr.0.w_r.bias", "image.rrr.0.bn.running_mean")
    assert_same_weights({k: v for k, v in resumed.items() if k not in noise},
                        {k: v for k, v in renamed.items() if k not in noise}, atol=1e-6)
    assert_same_weights({k: resumed[k] for k in noise}, {k: renamed[k] for k in noise}, atol=0.02)
    assert json.loads((run / "metrics.json").read_text())["test"]["full"] == pytest.approx(expected["test"]["full"])


def _load(path):
    from safetensors.torch import load_file

    return load_file(path)
