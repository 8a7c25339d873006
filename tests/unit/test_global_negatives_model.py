"""The cost model of all-gathered negatives (bench/global_negatives.py) against the bytes counted
by hand, and the docs' tables printed from the committed results."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bench_module

REPO = Path(__file__).resolve().parents[2]


def test_the_model_counts_the_bytes_of_a_ring_all_gather_and_all_reduce():
    row = {
        r["gpus"]: r
        for r in bench_module("global_negatives").project(rows=128, dim=2048, bytes_per_value=2, step_seconds=0.0545)
    }[1024]
    one_modality = 1023 * 128 * 2048 * 2  # every other rank's 128 rows of 2,048 bf16 values
    assert row["gathered_mb"] == pytest.approx(2 * one_modality / 1e6)
    assert row["backward_allreduce_mb"] == pytest.approx(2 * 2 * one_modality / 1e6)  # ring: twice the data
    assert row["comm_ms_allreduce"] == pytest.approx(6 * one_modality / 50e9 * 1e3)  # InfiniBand, 50 GB/s
    assert row["comm_ms_reduce_scatter"] == pytest.approx(4 * one_modality / 50e9 * 1e3)
    assert row["score_matrix_mb"] == pytest.approx(2 * 128 * 131072 * 4 / 1e6)
    assert row["share_of_step_allreduce"] == pytest.approx(row["comm_ms_allreduce"] / 54.5)


def test_the_docs_show_the_tables_of_the_committed_results():
    printed = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "global_negatives.py"),
            "--from",
            str(REPO / "docs" / "results" / "global_negatives.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    page = (REPO / "docs" / "distributed.md").read_text()
    measured, projected = printed.split("\n\n")
    assert measured in page and projected in page and page.index(measured) < page.index(projected)
    assert json.loads((REPO / "docs" / "results" / "global_negatives.json").read_text())["measured"][0]["ranks"] == 1
