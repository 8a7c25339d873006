"""bench/two_branch_ablation.py --phrase-shards: Table 1's phrase rows on another set (the hard
phrase variant) into runs and a results file of their own, the standard rows and results left as
they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import bench_module

REPO = Path(__file__).resolve().parents[2]


def _parser(monkeypatch, argv: list[str]):
    ar, bench = bench_module("ablation_runs"), bench_module("two_branch_ablation")
    parser = ar.ablation_parser(bench.__doc__, "two_branch", [row.key for row in bench.ROWS])
    monkeypatch.setattr(sys, "argv", ["two_branch_ablation.py", *argv])
    bench.options(parser)
    return parser.parse_args(argv), bench


def test_phrase_shards_default_to_runs_and_results_of_their_own(monkeypatch):
    args, bench = _parser(monkeypatch, ["--phrase-shards", "shards/synth-hard"])
    assert args.results == REPO / "docs" / "results" / "two_branch_phrases_hard.json"
    assert args.root == Path("runs") / "two_branch_phrases_hard"
    assert args.rows == ["embed-single", "embed-augmented", "embed-augmented-batch", "sim-single", "sim-augmented"]
    args, _ = _parser(monkeypatch, [])
    assert args.results == REPO / "docs" / "results" / "two_branch_ablation.json"
    assert args.root == Path("runs") / "two_branch_ablation"
    assert args.rows == [row.key for row in bench.ROWS] and args.phrase_shards is None
    # where things go can still be chosen
    args, _ = _parser(monkeypatch, ["--phrase-shards", "x", "--results", "/tmp/r.json", "--rows", "sim-single"])
    assert args.results == Path("/tmp/r.json") and args.rows == ["sim-single"]


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/two_branch_ablation.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_phrase_rows_train_on_the_phrase_shards_into_their_own_results(tmp_path):
    """Finished runs (kept, never trained again) of the phrase rows: the results file holds those
    rows only, every run's overrides name the phrase shards, and --from prints the phrase table."""
    bench = bench_module("two_branch_ablation")
    root, results = tmp_path / "runs", tmp_path / "hard.json"
    for i, row in enumerate(bench.PHRASE_ROWS):
        run = root / row.key / "seed0"
        run.mkdir(parents=True)
        phrases = {"r1": 40.0 + i, "r5": 70.0 + i, "r10": 85.0 + i}
        (run / "metrics.json").write_text(json.dumps({"test": {"phrases": phrases}}))
    done = _bench(
        "--phrase-shards", "shards/synth-hard", "--root", str(root), "--results", str(results), "--seeds", "0"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(results.read_text())
    assert data["method"] == "two_branch" and list(data["rows"]) == [row.key for row in bench.PHRASE_ROWS]
    assert "data.shards=shards/synth-hard" in data["common_overrides"]
    assert data["options"]["phrase_shards"] == "shards/synth-hard"
    assert data["command"] == "python bench/two_branch_ablation.py --seeds 0 --phrase-shards shards/synth-hard"
    assert data["rows"]["sim-single"]["runs"]["0"]["metrics"] == {
        "phrase_r1": 43.0,
        "phrase_r5": 73.0,
        "phrase_r10": 88.0,
    }
    shown = _bench("--from", str(results))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "| phrase localisation | R@1 |" in shown.stdout and "| retrieval |" not in shown.stdout
    assert "| similarity, single positive | 43.0 | 73.0 | 88.0 | 43.0 |" in shown.stdout


def test_phrase_shards_refuse_the_retrieval_rows(tmp_path):
    done = _bench(
        "--phrase-shards", "x", "--rows", "linear-bi", "--root", str(tmp_path), "--results", str(tmp_path / "r")
    )
    assert done.returncode != 0 and "phrase rows only" in done.stderr
    assert not (tmp_path / "linear-bi").exists()
