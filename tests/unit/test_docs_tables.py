"""Every ablation table in the docs comes from a committed result: `python bench/<method>_ablation.py
--from docs/results/<method>_ablation.json` prints blocks (tables, and the seed-spread comparisons
under them) that docs/<page>.md must hold verbatim, in order; and the shared table builder
(bench/ablation_runs.py) computes what it says."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bench_module

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RESULTS = REPO / "docs" / "results"
# method: (its bench, the page that shows its tables)
METHODS = {
    "vsrn": ("vsrn_ablation.py", "vsrn.md"),
    "two_branch": ("two_branch_ablation.py", "two-branch.md"),
    "cl": ("cl_ablation.py", "captioning.md"),
    "l2c": ("l2c_ablation.py", "l2c.md"),
    "laviter": ("laviter_ablation.py", "laviter.md"),
    "duplicates": ("duplicates_ablation.py", "benchmarks.md"),  # the demo before and after no self-negatives
}


def _from(script: str, results: Path) -> str:
    """What `python bench/<script> --from <results>` prints, run in this process: a fresh
    interpreter for each of the fifty-odd files cost about 0.8 s of the suite each, in imports.
    (That --from imports no torch is checked in a fresh one: test_from_prints_every_row_without_torch.)"""
    printed, argv, path = io.StringIO(), sys.argv, list(sys.path)
    sys.argv = [f"bench/{script}", "--from", str(results)]
    sys.path.insert(0, str(BENCH))  # as `python bench/<script>` puts its directory first
    try:
        with contextlib.chdir(REPO), contextlib.redirect_stdout(printed):
            runpy.run_path(str(BENCH / script), run_name="__main__")
    except SystemExit as stopped:
        assert not stopped.code, f"bench/{script} --from {results.name} exited with {stopped.code}"
    finally:
        sys.argv, sys.path[:] = argv, path
    return printed.getvalue()


def _committed_results() -> list:
    files = sorted(RESULTS.glob("*_ablation.json"))
    if not files:
        return [
            pytest.param(
                None,
                marks=pytest.mark.skip(reason="no docs/results/*_ablation.json committed yet (the issue-23 reruns)"),
            )
        ]
    return [pytest.param(path, id=path.stem) for path in files]


@pytest.mark.parametrize("results", _committed_results())
def test_the_docs_show_the_tables_of_the_committed_results(results):
    method = results.name.removesuffix("_ablation.json")
    assert method in METHODS, f"docs/results/{results.name}: no bench for {method!r} (METHODS in this test)"
    script, page = METHODS[method]
    command = f"python bench/{script} --from docs/results/{results.name}"
    doc = "\n\n" + (REPO / "docs" / page).read_text() + "\n\n"
    at = 0
    for block in _from(script, results).strip().split("\n\n"):
        found = doc.find("\n\n" + block + "\n\n", at)
        assert found >= 0, (
            f"docs/{page} does not hold this block of `{command}` (each block verbatim, "
            f"blank lines around it, in the command's order); replace its copy with:\n\n{block}"
        )
        at = found + len(block)


# results files other benches print a table of with --from: file -> (bench, page)
OTHER_TABLES = {
    "reasoning_identity_vsrn.json": ("reasoning_identity.py", "vsrn.md"),
    "reasoning_identity_l2c.json": ("reasoning_identity.py", "l2c.md"),
    "decoder_launches.json": ("decoder_launches.py", "benchmarks.md"),
    "step_throughput_cpu2.json": ("step_throughput.py", "benchmarks.md"),
    "step_throughput_cpu2_xeon.json": ("step_throughput.py", "benchmarks.md"),
    "step_throughput_h200.json": ("step_throughput.py", "benchmarks.md"),
    "loader_cpu.json": ("loader_cpu.py", "performance.md"),
    "vs_official.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_xeon.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_xeon_before_demo.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_xeon_before_paper.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_xeon_decoder.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_epyc_1201.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_epyc_1204.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_epyc_1204_fused.json": ("vs_official.py", "benchmarks.md"),
    "vs_official_epyc_1204b.json": ("vs_official.py", "benchmarks.md"),
    "demo_times.json": ("demo_times.py", "performance.md"),
    "demo_times_bf16.json": ("demo_times.py", "performance.md"),
    "cpu_bf16.json": ("cpu_bf16.py", "performance.md"),
    "cpu_cnn_steps.json": ("cpu_cnn_steps.py", "performance.md"),
    "demo_times_l2c_auto.json": ("demo_times.py", "performance.md"),
    "demo_times_auto_epyc.json": ("demo_times.py", "performance.md"),
    "demo_times_vsrn_epyc_1204.json": ("demo_times.py", "performance.md"),
    "demo_times_bf16_vsrn_laviter_epyc.json": ("demo_times.py", "performance.md"),
    "cpu_bf16_epyc.json": ("cpu_bf16.py", "performance.md"),
    "cpu_cnn_steps_epyc.json": ("cpu_cnn_steps.py", "performance.md"),
    "cpu_optimizer_step.json": ("cpu_optimizer_step.py", "performance.md"),
    "exact_data.json": ("exact_data.py", "benchmarks.md"),
    "fault_soak.json": ("fault_soak.py", "preemption.md"),
    "accumulate_negatives.json": ("accumulate_negatives.py", "benchmarks.md"),
    "activation_checkpointing.json": ("activation_checkpointing.py", "benchmarks.md"),
    "fsdp_memory.json": ("fsdp_memory.py", "benchmarks.md"),
    "two_branch_phrases_hard.json": ("two_branch_ablation.py", "two-branch.md"),
}


@pytest.mark.parametrize("name", [name for name in OTHER_TABLES if (RESULTS / name).is_file()])
def test_the_docs_show_the_other_tables_of_committed_results(name):
    script, page = OTHER_TABLES[name]
    table = _from(script, RESULTS / name).strip()
    assert table in (REPO / "docs" / page).read_text(), (
        f"docs/{page} does not hold `python bench/{script} --from docs/results/{name}` verbatim:\n\n{table}"
    )


def test_every_ablation_has_results():
    found = {path.name for path in RESULTS.glob("*_ablation.json")}
    expected = {f"{method}_ablation.json" for method in METHODS}
    assert found == expected, f"docs/results/: missing {sorted(expected - found)}, unknown {sorted(found - expected)}"


# ---------------------------------------------------------------- the shared builder


def _toy(runs: dict[str, dict[str, list[float]]], seeds=(0, 1, 2)) -> dict:
    """A results file's content: row -> metric -> one value per seed."""
    return {
        "schema": "vldist-ablation/1",
        "method": "toy",
        "seeds": list(seeds),
        "rows": {
            key: {
                "label": key,
                "job": "toy",
                "overrides": [],
                "runs": {
                    str(s): {
                        "metrics": {m: values[i] for m, values in metrics.items()},
                        "seconds": None,
                        "commit": None,
                    }
                    for i, s in enumerate(seeds)
                },
            }
            for key, metrics in runs.items()
        },
    }


def test_the_table_holds_mean_and_sample_std_each_seed_and_the_paper():
    ar = bench_module("ablation_runs")
    x_base, y_base, x_plus = [10.0, 12.5, 11.0], [0.1, 0.25, 0.4], [20.0, 21.0, 26.0]
    data = _toy({"base*": {"x": x_base, "y": y_base}, "plus": {"x": x_plus}})
    rows = [ar.Row("plus", "plus", "toy"), ar.Row("base*", "base*", "toy"), ar.Row("absent", "absent", "toy")]
    text = ar.ablation_table(
        data,
        rows,
        [ar.Col("x", "x"), ar.Col("y", "y x 100", 2, scale=100)],
        per_seed=ar.Col("x", "x"),
        paper={"base*": {"x": "9.87", "y": 0.5}},
        paper_cols=[ar.Col("x", "paper x"), ar.Col("y", "paper y", 2)],
        first="model",
    )
    mean, std = statistics.mean, statistics.stdev
    y100 = [100 * v for v in y_base]
    assert text.splitlines() == [
        "| model | x | y x 100 | x per seed (0 / 1 / 2) | paper x | paper y |",
        "|---|---|---|---|---|---|",
        f"| plus | {mean(x_plus):.1f} ± {std(x_plus):.1f} | n/a | 20.0 / 21.0 / 26.0 | – | – |",
        f"| base\\* | {mean(x_base):.1f} ± {std(x_base):.1f} | {mean(y100):.2f} ± {std(y100):.2f} "
        f"| 10.0 / 12.5 / 11.0 | 9.87 | 0.50 |",
    ]
    assert ar.ablation_table(data, [ar.Row("absent", "absent", "toy")], [ar.Col("x", "x")]) == ""


def test_one_seed_shows_the_value_alone_and_a_missing_seed_is_an_error():
    ar = bench_module("ablation_runs")
    one = _toy({"a": {"x": [3.14159]}}, seeds=[7])
    assert ar.ablation_table(one, [ar.Row("a", "a", "toy")], [ar.Col("x", "x", 2)]).splitlines()[2] == "| a | 3.14 |"
    assert ar.spread_line(one, [ar.Row("a", "a", "toy")], ar.Col("x", "x"), [("a", "a")]) == ""  # no spread
    gap = _toy({"a": {"x": [1.0, 2.0]}}, seeds=[0, 1])
    gap["seeds"] = [0, 1, 2]
    with pytest.raises(ValueError, match="seed"):
        ar.ablation_table(gap, [ar.Row("a", "a", "toy")], [ar.Col("x", "x")])


def test_rows_differ_only_beyond_the_two_sample_stds_added():
    ar = bench_module("ablation_runs")
    a, b, c = [10.0, 11.0, 12.0], [14.0, 15.0, 16.5], [11.0, 13.0, 15.0]
    data = _toy({"a": {"x": a}, "b": {"x": b}, "c": {"x": c}})
    rows = [ar.Row(k, k.upper(), "toy") for k in "abc"]
    assert statistics.mean(b) - statistics.mean(a) > statistics.stdev(a) + statistics.stdev(b)
    assert abs(statistics.mean(c) - statistics.mean(b)) <= statistics.stdev(b) + statistics.stdev(c)
    lines = ar.spread_line(data, rows, ar.Col("x", "x"), [("a", "b"), ("b", "c"), ("c", "a"), ("a", "absent")])
    bullets = [line for line in lines.splitlines() if line.startswith("- ")]
    assert bullets[0].startswith("- A < B (Δ +4.2, ")
    assert bullets[1].startswith("- B ≈ C (Δ -2.2, ")
    assert bullets[2].startswith("- C ≈ A (Δ -2.0, stds 2.0 + 1.0)")  # 2.0 apart, within 2 + 1
    assert len(bullets) == 3


def test_results_files_hold_no_absolute_path_and_the_command_only_what_changes_results(tmp_path):
    ar = bench_module("ablation_runs")
    assert ar.portable(str(REPO / "shards" / "synth")) == "shards/synth"
    assert ar.portable("/somewhere/else/shards") == "<outside>/shards"
    assert ar.portable(f"data.shards={REPO / 'shards' / 'synth'}") == "data.shards=shards/synth"
    assert ar.portable("model.terms=full") == "model.terms=full"
    parser = ar.ablation_parser("doc", "toy", ["a", "b"])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--shards")
    args = parser.parse_args(
        [
            "--seeds",
            "0",
            "1",
            "--rows",
            "b",
            "--steps",
            "2",
            "--root",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "r.json"),
            "--shards",
            "/data/shards",
        ]
    )
    assert (
        ar.command_line(parser, args, "toy_ablation.py")
        == "python bench/toy_ablation.py --seeds 0 1 --rows b --steps 2 --shards '<outside>/shards'"
    )
    assert ar.bench_options(parser, args) == {"steps": 2, "shards": "<outside>/shards"}
    assert (
        ar.command_line(parser, parser.parse_args([]), "toy_ablation.py")
        == "python bench/toy_ablation.py --seeds 0 1 2"
    )
    assert parser.parse_args([]).results == REPO / "docs" / "results" / "toy_ablation.json"


def test_a_kept_run_carries_its_record_into_the_results(tmp_path, capsys):
    """A finished run is not trained again; its seconds, commit and torch version (the same commit
    on another torch trains to other last digits) and the precision it ran in (a job's auto is bf16
    on an AMX CPU) reach the results file's entry."""
    ar = bench_module("ablation_runs")
    run_dir = tmp_path / "row" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text(json.dumps({"test": {"rsum": 101.5}, "precision": "bf16"}))
    (run_dir / ar.RUN_RECORD).write_text(json.dumps({"seconds": 12.5, "commit": "abc1234", "torch": "2.14.1"}))
    run = ar.train_once("vsrn", run_dir, [])
    assert run.kept and (run.seconds, run.commit, run.torch) == (12.5, "abc1234", "2.14.1")
    record = ar.Recorder([ar.Col("rsum", "rsum")])
    record(ar.Row("row", "Row", "vsrn"), 0, run, ar.pick(run.metrics, {"rsum": ("test", "rsum")}))
    assert record.rows["row"]["runs"]["0"] == {
        "metrics": {"rsum": 101.5},
        "seconds": 12.5,
        "commit": "abc1234",
        "torch": "2.14.1",
        "precision": "bf16",
    }
    assert "Row, seed 0: rsum 101.5 (kept)" in capsys.readouterr().out
    (run_dir / ar.RUN_RECORD).unlink()  # trained before runs were recorded: all unknown
    assert (ar.train_once("vsrn", run_dir, []).torch, ar.train_once("vsrn", run_dir, []).commit) == (None, None)


def test_pick_keeps_the_named_numbers_a_run_reported():
    ar = bench_module("ablation_runs")
    metrics = {"test": {"full": {"rsum": 400.5}, "captions": {"meteor": float("nan")}}, "best_epoch": 15}
    paths = {
        "rsum": ("test", "full", "rsum"),
        "meteor": ("test", "captions", "meteor"),
        "best_epoch": ("best_epoch",),
        "s2s": ("test", "sentence_to_sentence", "r1"),
    }
    assert ar.pick(metrics, paths) == {"rsum": 400.5, "best_epoch": 15}


# ---------------------------------------------------------------- each bench's --from


@pytest.mark.parametrize("method", sorted(METHODS))
def test_from_prints_every_row_without_torch(method, tmp_path):
    """Each bench's --from on a results file of made-up numbers for all its rows: a table line per
    row, exit 0, and torch never imported (--from must stay fast)."""
    script, _ = METHODS[method]
    bench = bench_module(script.removesuffix(".py"))
    rows = getattr(bench, "ALL_ROWS", bench.ROWS)
    values = {name: (500 if name == "sr_pool" else 0.1 + i) for i, name in enumerate(bench.METRICS)}
    data = _toy({row.key: {name: [v, v + 0.5, v + 2.0] for name, v in values.items()} for row in rows})
    data["method"] = method
    for row in rows:
        data["rows"][row.key]["label"] = row.label
    path = tmp_path / f"{method}_ablation.json"
    path.write_text(json.dumps(data))
    run_guarded = (
        "import runpy, sys; script = sys.argv[1]; sys.argv = sys.argv[1:]; sys.path.insert(0, 'bench'); "
        "runpy.run_path(script, run_name='__main__'); "
        "assert 'torch' not in sys.modules, '--from imported torch'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run_guarded, f"bench/{script}", "--from", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for row in rows:
        assert any(line.startswith(f"| {row.label.replace('*', chr(92) + '*')} | ") for line in lines), row.label
    if method == "cl":  # self-retrieval R@500 over a pool of 500 is 100 by construction: not shown
        assert "R@50 |" in proc.stdout and "R@500" not in proc.stdout


def test_from_refuses_another_benchs_results(tmp_path):
    path = tmp_path / "l2c_ablation.json"
    path.write_text(json.dumps({**_toy({}), "method": "l2c"}))
    proc = subprocess.run(
        [sys.executable, "bench/vsrn_ablation.py", "--from", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not of 'vsrn'" in proc.stderr


def test_update_keeps_the_rows_not_rerun_and_refuses_what_would_not_be_one_table():
    """--update: the rows this invocation trained replace theirs, the others stay with their own
    runs, in the bench's order; other seeds, options or a row whose overrides changed since its
    runs stop the bench instead of mixing them into one table."""
    ar = bench_module("ablation_runs")

    def results(rows: dict, command: str, **extra) -> dict:
        data = _toy(rows)
        data.update({"command": command, "options": {"epochs": 8}, "common_overrides": ["train.epochs=8"], **extra})
        for key in data["rows"]:
            data["rows"][key]["overrides"] = [f"model.{key}=1"]
        return data

    old = results({"a": {"x": [1.0, 2.0, 3.0]}, "b": {"x": [4.0, 5.0, 6.0]}}, "python bench/toy.py")
    new = results({"b": {"x": [7.0, 8.0, 9.0]}}, "python bench/toy.py --rows b")
    rows = [ar.Row("a", "a", "toy", ["model.a=1"]), ar.Row("b", "b", "toy", ["model.b=1"]), ar.Row("c", "c", "toy")]
    merged = ar.updated_results(old, new, rows)
    assert list(merged["rows"]) == ["a", "b"]
    assert merged["rows"]["a"] == old["rows"]["a"] and merged["rows"]["b"] == new["rows"]["b"]
    assert merged["command"] == "python bench/toy.py --rows b"
    assert merged["earlier_commands"] == ["python bench/toy.py"]
    # a kept row trained with other overrides than its row has now
    changed = [ar.Row("a", "a", "toy", ["model.a=2"]), rows[1]]
    with pytest.raises(SystemExit, match=r"\['a'\]"):
        ar.updated_results(old, new, changed)
    # other seeds or options
    with pytest.raises(SystemExit, match="seeds"):
        ar.updated_results(old, {**new, "seeds": [0, 1]}, rows)
    with pytest.raises(SystemExit, match="epochs"):
        ar.updated_results(old, {**new, "options": {"epochs": 4}}, rows)
    # an option added to the bench since, at its default (None), is the old file's
    assert ar.updated_results(old, {**new, "options": {"epochs": 8, "phrase_shards": None}}, rows)["rows"]["a"]
