"""The train and evaluate entry points as users run them, on a small real shard set."""

import json
import subprocess
import sys

import pytest
import torch

from vldist.errors import NonFiniteLossError
from vldist.recipes.jobs import load_config
from vldist.training.on_each_rank import run

SMALL = [
    "model.embed_size=64",
    "model.decoder_hidden=64",
    "model.word_dim=32",
    "data.batch_size=32",
    "data.shuffle_buffer=100",
    "data.eval_batch_size=32",
    "train.log_every=5",
]


def _cli(module, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def trained_run(planted_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = _cli(
        "vldist.train",
        "vsrn",
        f"data.shards={planted_shards}",
        f"output.dir={out}",
        "train.epochs=6",
        "train.lr=0.001",
        *SMALL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_train_writes_checkpoint_metrics_and_prints_the_table(trained_run):
    out, proc = trained_run
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 * 7  # ceil(200 / 32) steps per epoch
    assert (out / "checkpoints" / "best" / "COMPLETE").is_file()
    steps = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert steps == ["step-00000035", "step-00000042"]  # the last two epoch ends (keep_last=2)
    for row in ("chance", "untrained", "trained"):
        assert row in proc.stdout
    trained, untrained = metrics["test"]["full"], metrics["untrained"]["full"]
    assert trained["rsum"] > untrained["rsum"] + 50
    assert len(metrics["history"]) == 6 and all("val" in h for h in metrics["history"])


def test_progress_is_recorded_as_json_lines(trained_run):
    out, proc = trained_run
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == [*range(5, 42, 5), 42]  # every train.log_every=5 steps, and the last
    assert all(e["samples_per_second"] > 0 and 0 <= e["data_wait_share"] <= 1 for e in train)
    assert [e["epoch"] for e in events if e["event"] == "validation"] == [1, 2, 3, 4, 5, 6]
    assert "step 42/42" in proc.stderr and "samples/s" in proc.stderr and "eta" in proc.stderr


def test_evaluate_reproduces_the_training_metrics(trained_run):
    out, _ = trained_run
    proc = _cli("vldist.evaluate", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout[proc.stdout.index("{") :])
    expected = json.loads((out / "metrics.json").read_text())["test"]["full"]
    for key, value in expected.items():
        assert printed["full"][key] == pytest.approx(value, abs=1e-6), key


def test_config_typo_exits_2_with_the_key_named(planted_shards):
    proc = _cli("vldist.train", "vsrn", f"data.shards={planted_shards}", "train.lr_decay=3")
    assert proc.returncode == 2
    assert "unknown key 'train.lr_decay'" in proc.stderr and "lr_decay_epochs" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_shards_exit_2_with_the_build_command(tmp_path):
    proc = _cli("vldist.train", "vsrn", f"data.shards={tmp_path / 'absent'}")
    assert proc.returncode == 2
    assert "python -m vldist.shards synth --out" in proc.stderr


def test_help_lists_recipes_and_keys():
    proc = _cli("vldist.train", "--help")
    assert proc.returncode == 0
    assert "vsrn" in proc.stdout and "model.rrr_layers = 4" in proc.stdout


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(planted_shards, tmp_path, monkeypatch):
    from vldist.recipes.vsrn import VSRNRecipe

    config = load_config(
        "vsrn",
        [
            f"data.shards={planted_shards}",
            f"output.dir={tmp_path}",
            "train.epochs=3",
            "eval.baseline=false",
            "data.workers=0",
            *SMALL,
        ],
    )
    real_losses, calls = VSRNRecipe.losses, {"n": 0}

    def poisoned(self, outputs, batch, update="main", model=None):
        calls["n"] += 1
        out = real_losses(self, outputs, batch, update, model)
        if calls["n"] > 10:  # after the first epoch (7 steps) has been checkpointed
            out["loss"] = out["loss"] * torch.tensor(float("nan"))
        return out

    monkeypatch.setattr(VSRNRecipe, "losses", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 11"):
        run(config)
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-00000007"]


@pytest.mark.parametrize("baseline", ["true", "false"])
def test_a_recipe_whose_evaluation_lacks_its_counts_is_refused_before_training(
    planted_shards, tmp_path, monkeypatch, capsys, baseline
):
    """Without the untrained baseline, the first validation batch is evaluated and checked first."""
    import vldist.recipes
    from vldist.recipes.vsrn import VSRNRecipe
    from vldist.train import main

    class Countless(VSRNRecipe):
        def evaluate(self, model, batches, device, validation=False):
            metrics = super().evaluate(model, batches, device, validation)
            del metrics["n_images"]
            return metrics

    monkeypatch.setitem(vldist.recipes.RECIPES, "vsrn", Countless)
    out = tmp_path / "run"
    code = main(
        [
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={out}",
            f"eval.baseline={baseline}",
            "data.workers=0",  # the recipe, a local class, would not pickle to a fork server's worker
            *SMALL,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "error: recipe 'vsrn': evaluate() returned no 'n_images' (the number of images" in err
    assert "Traceback" not in err
    assert not list(out.glob("checkpoints/step-*")) and not (out / "metrics.jsonl").exists()  # no step was taken
