"""The table from error to exit code and message (vldist/exit_codes.py), as docs/bad-input.md lists it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vldist.errors import (
    CaptionMetricsError,
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    EmptySplitError,
    IncompatibleCheckpoint,
    JavaNotFoundError,
    NonFiniteLossError,
    OutputDirInUse,
    ReplicasDiverged,
    RunDirectoryTaken,
    RunFailed,
    RunStopped,
    ShardsNotFoundError,
    ShardsUnfitError,
    StoreLost,
    StoreSupportMissing,
    StoreUnreachable,
    TrainingStopped,
)
from vldist.exit_codes import (
    DIVERGED,
    FAILED,
    INTERRUPTED,
    INTERRUPTED_MESSAGE,
    REFUSED,
    REPORTED_ERRORS,
    STOPPED,
    exit_status,
)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError,
        ShardsNotFoundError,
        ShardsUnfitError,
        CheckpointError,
        IncompatibleCheckpoint,
        OutputDirInUse,
        RunDirectoryTaken,
        JavaNotFoundError,
        StoreSupportMissing,
        StoreUnreachable,
    ],
)
def test_refusals_exit_2_with_the_error_line(error):
    assert exit_status(error("what is wrong")) == (REFUSED, "error: what is wrong") == (2, "error: what is wrong")


@pytest.mark.parametrize(
    "error", [RunFailed, CheckpointWriteError, EmptySplitError, CaptionMetricsError, NonFiniteLossError, StoreLost]
)
def test_failures_exit_1_with_the_error_line(error):
    assert exit_status(error("what failed")) == (FAILED, "error: what failed") == (1, "error: what failed")


def test_diverged_replicas_exit_4_with_the_error_line():
    assert (
        exit_status(ReplicasDiverged("rank 1 differs"))
        == (DIVERGED, "error: rank 1 differs")
        == (4, "error: rank 1 differs")
    )


def test_a_missing_java_refuses_although_it_is_a_caption_metrics_error():
    assert issubclass(JavaNotFoundError, CaptionMetricsError)
    assert exit_status(JavaNotFoundError("no java"))[0] == REFUSED


def test_a_stop_exits_75_with_its_own_message():
    stopped = TrainingStopped(14, Path("runs/x/checkpoints/step-00000014"), "SIGTERM")
    assert exit_status(stopped) == (STOPPED, str(stopped)) and STOPPED == 75
    assert exit_status(RunStopped("stopped on request")) == (75, "stopped on request")


def test_ctrl_c_exits_130_but_is_not_a_reported_error():
    assert exit_status(KeyboardInterrupt()) == (INTERRUPTED, INTERRUPTED_MESSAGE) and INTERRUPTED == 130
    assert INTERRUPTED_MESSAGE.startswith("interrupted: nothing after the last checkpoint was kept")
    assert KeyboardInterrupt not in REPORTED_ERRORS  # evaluate and caption let Python end on it


def test_an_error_outside_the_table_has_no_exit_code():
    assert not isinstance(ValueError("a bug"), REPORTED_ERRORS)
    with pytest.raises(TypeError, match="ValueError has no exit code"):
        exit_status(ValueError("a bug"))


def test_the_table_imports_the_error_types_alone():
    """Mapping errors to codes loads no platform: a fresh interpreter importing exit_codes holds
    vldist, vldist.errors and vldist.exit_codes, and neither torch nor any other vldist module."""
    code = "import json, sys, vldist.exit_codes; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert [m for m in loaded if m == "vldist" or m.startswith("vldist.")] == [
        "vldist",
        "vldist.errors",
        "vldist.exit_codes",
    ]
    assert "torch" not in loaded


def test_every_reported_error_is_defined_in_errors_py():
    """One home for the error types, so that nothing else need be imported to map them."""
    assert {error.__module__ for error in REPORTED_ERRORS} == {"vldist.errors"}
