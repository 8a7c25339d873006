"""What bench/demo_times.py reads and reports: the trainer's thread count (train.threads), the
seconds each kind of evaluation took (metrics.json `evaluation_seconds`), the bench's split of a
command's wall time into phases (docs/performance.md's table: tests/unit/test_docs_tables.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import bench_module

from vldist.training import evaluations
from vldist.training.threads import set_torch_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_train_threads_sets_torchs_thread_count_and_none_keeps_it(restore_threads):
    torch.set_num_threads(2)
    assert set_torch_threads(None) == 2 and torch.get_num_threads() == 2
    assert set_torch_threads(1) == 1 and torch.get_num_threads() == 1


def test_evaluation_seconds_add_up_per_kind(monkeypatch):
    """Two validations of 1.5 s and 2.25 s sum; the test's 4 s stands apart, also after an error."""
    clock = iter([10.0, 11.5, 20.0, 22.25, 30.0, 34.0])
    monkeypatch.setattr(evaluations.time, "perf_counter", lambda: next(clock))
    ev = object.__new__(evaluations.Evaluations)
    ev.seconds = {}
    with ev._timed("validation"):
        pass
    with ev._timed("validation"):
        pass
    with pytest.raises(RuntimeError), ev._timed("test"):
        raise RuntimeError("an evaluation that failed still took its time")
    assert ev.seconds == {"validation": 3.75, "test": 4.0}


def test_phases_split_the_wall_time_over_the_stages():
    bench = bench_module("demo_times")
    test = {"captions": {"cider_d": 1.5, "bleu4": 0.4, "rouge_l": 0.6}, "n_images": 10, "n_captions": 50}
    stages = {
        "mle": {
            "recipe": "captioner",
            "wall_seconds": 100.0,
            "train_seconds": 80.0,
            "steps": 30,
            "evaluation_seconds": {"baseline": 20.0, "validation": 5.0, "test": 19.0},
            "test": test,
        },
        "cl": {
            "recipe": "captioner",
            "wall_seconds": 50.0,
            "train_seconds": 30.0,
            "steps": 10,
            "evaluation_seconds": {"contract_check": 1.0, "test": 18.0},
            "test": test,
        },
    }
    row = bench.phases(160.0, stages)
    assert row["outside_s"] == 160.0 - 150.0
    assert row["untrained_s"] == 20.0 + 1.0
    assert row["validation_s"] == 5.0 and row["test_s"] == 19.0 + 18.0
    # each stage's run less its evaluations before the test: (80 - 20 - 5) + (30 - 1)
    assert row["training_s"] == 55.0 + 29.0
    assert row["steps"] == 40
    assert row["test"]["mle"]["cider_d"] == 1.5
