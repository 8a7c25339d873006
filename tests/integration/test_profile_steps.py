"""Profiles on demand (train.profile_steps, vldist/telemetry/profiling.py): the window's steps and
only they in a trace Perfetto opens, and the top operators printed."""

import json

import pytest
from helpers import profiled_vsrn, train_vsrn

from vldist.config import profile_window


def test_the_window_is_recorded_in_a_trace_and_its_top_operators_printed(planted_shards, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    said = profiled_vsrn(capsys, caplog, planted_shards, out, 4, "2:3", "data.workers=0")
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["rank0-steps-2-3.json"]
    events = json.loads((out / "profile" / "rank0-steps-2-3.json").read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("step ")})
    assert steps == ["step 2", "step 3"]  # the window, not the steps around it
    operators = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::gru_cell"} & operators or "aten::addmm" in operators
    table = said[said.index("profile: top operators by self CPU time") :].splitlines()
    rows = [line.split() for line in table[2:12] if line.startswith("aten::")]
    assert rows, said[-2000:]
    shares = [float(row[-2].rstrip("%")) for row in rows]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.05
    assert f"trace: {out / 'profile' / 'rank0-steps-2-3.json'}" in said


@pytest.mark.parametrize("window", ["3:2", "0:2", "2", "a:b", "2:"])
def test_a_window_that_is_not_A_to_B_is_refused_naming_the_form(window):
    with pytest.raises(ValueError, match="write A:B with 1 <= A <= B"):
        profile_window(window)


def test_a_bad_window_is_refused_before_anything_runs(capsys, tmp_path):
    code, err = train_vsrn(capsys, f"output.dir={tmp_path / 'run'}", "train.profile_steps=5:1")
    assert code == 2 and "Traceback" not in err and not (tmp_path / "run").exists(), err
    assert err.splitlines() == [
        "error: invalid job config:",
        "  train.profile_steps: Value error, not a window of steps: write A:B with 1 <= A <= B, e.g. 5:8 (got '5:1')",
    ]
