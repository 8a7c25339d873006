"""Profiles on a CUDA GPU (skipped without one; the CPU path is test_profile_steps.py): the trace
holds device kernels, the memory snapshot of the window is written, and the top operators are
ranked by device time."""

import json
import pickle

import pytest
import torch
from helpers import profiled_vsrn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_cuda_window_writes_kernels_and_a_memory_snapshot(planted_shards, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    said = profiled_vsrn(capsys, caplog, planted_shards, out, 3, "2:2", "train.device=cuda")
    profile = out / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0-steps-2-2-memory.pickle", "rank0-steps-2-2.json"]
    events = json.loads((profile / "rank0-steps-2-2.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    snapshot = pickle.loads((profile / "rank0-steps-2-2-memory.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]
    assert "profile: top operators by self device time" in said
    # the progress records carry the CUDA peak (what bench/step_throughput.py reports on a GPU)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["cuda_peak_memory_bytes"] for r in records if r.get("event") == "train"]
    assert peaks and all(p > 0 for p in peaks)
