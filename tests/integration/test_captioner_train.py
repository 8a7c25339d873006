"""The captioner from the command line: train on planted shards, then evaluate the run.

Planted captions name the three words each image's regions encode, in random order, so a model
that learns to read the regions reaches a high BLEU-1 while an untrained one cannot.
"""

import json
import shutil
from pathlib import Path

import pytest
from trackers_readback import tensorboard_texts, wandb_history

from vldist.evaluate import main as evaluate_main
from vldist.train import main as train_main

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap needs Java")

TINY = [
    "model.hidden=48",
    "model.embed=32",
    "model.dropout=0.1",
    "data.batch_size=20",
    "data.eval_batch_size=30",
    "data.shuffle_buffer=50",
    "data.max_regions=3",
    "data.vocab_min_count=1",
    "train.lr=0.005",
    "train.epochs=8",
    "train.lr_decay_epochs=100",
    "train.validate_every=4",
    "eval.self_retrieval_pool=40",
    "eval.examples=2",
    "metrics.enabled=false",
]


def test_captioner_trains_and_evaluates_from_the_cli(planted_shards, tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        train_main(
            [
                "captioner",
                f"data.shards={planted_shards}",
                f"output.dir={run}",
                *TINY,
                "metrics.trackers=[tensorboard,wandb,mlflow]",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "R@50" not in printed and "R@500" not in printed  # K >= the pool of 40: 100 by construction, not shown
    for column in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "R@1", "R@5"):
        assert column in printed
    assert "untrained" in printed and "generated:" in printed and "reference:" in printed

    results = json.loads((run / "metrics.json").read_text())
    trained, untrained = results["test"], results["untrained"]
    # measured: BLEU-1 0.70 against 0.02, CIDEr-D 2.37 against 0.00, self-retrieval R@1 95% against 2.5%
    assert trained["captions"]["bleu1"] > 0.5 > untrained["captions"]["bleu1"] + 0.3, (trained, untrained)
    assert trained["captions"]["cider_d"] > untrained["captions"]["cider_d"] + 1.0
    assert trained["self_retrieval"]["r1"] > 50 > untrained["self_retrieval"]["r1"]
    assert trained["self_retrieval"]["n_images"] == 40 and set(trained["self_retrieval"]) == {"r1", "r5", "n_images"}
    assert trained["n_images"] == 60 and trained["n_captions"] == 300
    assert [e["event"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())].count(
        "validation"
    ) == 2
    assert "self_retrieval" not in results["history"][-1]["val"]  # validation selects by CIDEr-D only

    # the trackers hold each evaluation's generated captions beside their references
    texts = tensorboard_texts(run / "trackers" / "tensorboard" / "run")
    assert [step for step, _ in texts["captions/val"]] == [h["step"] for h in results["history"] if "val" in h]
    step, table = texts["captions/test"][-1]
    assert table.startswith("| image | generated | references |") and step == results["steps"]
    for example in trained["examples"]:
        references = " \\| ".join(example["references"])  # a cell's own | escaped in markdown
        assert f"| {example['key']} | {example['generated']} | {references} |" in table
    (wandb_run,) = (run / "trackers" / "wandb").glob("offline-run-*")
    (logged,) = [row for row in wandb_history(next(wandb_run.glob("run-*.wandb"))) if "captions/test/path" in row]
    table = json.loads((wandb_run / "files" / json.loads(logged["captions/test/path"])).read_text())
    assert table["columns"] == ["image", "generated", "references"] and int(logged["_step"]) == results["steps"]
    assert [row[1] for row in table["data"]] == [e["generated"] for e in trained["examples"]]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "trackers" / "mlruns").resolve().as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("captioner").experiment_id])
    logged = json.loads(
        (
            Path(mlrun.info.artifact_uri.removeprefix("file://"))
            / "captions"
            / "test"
            / f"step-{results['steps']:08d}.json"
        ).read_text()
    )
    assert logged["columns"] == ["image", "generated", "references"]
    assert [row[1] for row in logged["data"]] == [e["generated"] for e in trained["examples"]]

    # the saved best checkpoint evaluates to the same numbers
    assert evaluate_main([str(run), "--json"]) == 0
    out = capsys.readouterr().out
    table = out[: out.index("{")]  # the report comes first: metrics, then captions beside references
    for column in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "R@1"):
        assert column in table
    assert table.count("generated:") == 2 and "reference:" in table, table
    again = json.loads(out[out.index("{") :])
    assert again["captions"] == pytest.approx(trained["captions"])
    assert again["self_retrieval"] == pytest.approx(trained["self_retrieval"])


def test_without_java_training_is_refused_before_it_starts(planted_shards, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no java on it
    run = tmp_path / "run"
    assert train_main(["captioner", f"data.shards={planted_shards}", f"output.dir={run}", *TINY]) == 2
    err = capsys.readouterr().err
    assert "pycocoevalcap needs Java" in err and "apt-get install -y default-jre-headless" in err, err
    assert "Traceback" not in err and not (run / "checkpoints").exists()
