"""Exit codes of the commands (`vldist.train`, `vldist.evaluate`, `vldist.caption`) and the one
table that says which error ends a command with which code and message (docs/bad-input.md).
It imports the error types alone (errors.py), none of the platform that raises them."""

from __future__ import annotations

from vldist.errors import (
    CaptionMetricsError,
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    EmptySplitError,
    IncompatibleCheckpoint,
    Interrupted,
    JavaNotFoundError,
    NonFiniteLossError,
    OutputDirInUse,
    OutputNotWritable,
    PeerLost,
    ReplicasDiverged,
    RunDirectoryTaken,
    RunFailed,
    RunStopped,
    ShardsNotFoundError,
    ShardsUnfitError,
    StoreLost,
    StoreSupportMissing,
    StoreUnreachable,
    TooManySkipped,
    TrainingStopped,
)

DONE = 0
FAILED = 1  # failed while it ran; what was checkpointed before stays usable
REFUSED = 2  # refused before anything ran or was written
HUNG = 3  # no rank advanced for train.hang_timeout_s (the watchdog's os._exit, no exception)
DIVERGED = 4  # the ranks' replicas of the model differ (train.replica_check_every)
# sysexits.h EX_TEMPFAIL, "try again later": stopped on request after checkpointing, and the same
# command with train.resume=auto carries on. Slurm's train.sbatch requeues on it.
STOPPED = 75
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, what a shell reports): ended at once

# Checked in this order, so that an error of two rows takes the first: JavaNotFoundError is a
# CaptionMetricsError, and refuses to start rather than fails.
EXIT_CODES: tuple[tuple[int, tuple[type[BaseException], ...]], ...] = (
    (
        REFUSED,
        (
            ConfigError,
            ShardsNotFoundError,
            ShardsUnfitError,
            CheckpointError,
            IncompatibleCheckpoint,
            OutputDirInUse,
            OutputNotWritable,
            RunDirectoryTaken,
            JavaNotFoundError,
            StoreSupportMissing,
            StoreUnreachable,
        ),
    ),
    (
        FAILED,
        (
            RunFailed,
            PeerLost,
            CheckpointWriteError,
            EmptySplitError,
            CaptionMetricsError,
            NonFiniteLossError,
            StoreLost,
            TooManySkipped,
        ),
    ),
    (DIVERGED, (ReplicasDiverged,)),
    (STOPPED, (TrainingStopped, RunStopped)),
    (INTERRUPTED, (KeyboardInterrupt,)),
)

# The errors a command reports in one line instead of a traceback. Ctrl-C is not among them: only
# training says what it kept (catching KeyboardInterrupt itself); the others let Python end on it.
REPORTED_ERRORS: tuple[type[Exception], ...] = tuple(
    error for code, errors in EXIT_CODES if code != INTERRUPTED for error in errors
)

INTERRUPTED_MESSAGE = (
    "interrupted: nothing after the last checkpoint was kept (train.resume=latest carries on "
    "from it; train.stop_signals=[SIGTERM,SIGUSR1,SIGINT] checkpoints on Ctrl-C)"
)


def exit_status(error: BaseException) -> tuple[int, str]:
    """(exit code, the line to print on stderr) for one of REPORTED_ERRORS or a KeyboardInterrupt."""
    for code, errors in EXIT_CODES:
        if isinstance(error, errors):
            if code == STOPPED:
                return code, str(error)  # it says itself what was saved and how to carry on
            if code == INTERRUPTED:  # what was interrupted, where it says so itself (Interrupted)
                return code, f"interrupted: {error}" if isinstance(error, Interrupted) else INTERRUPTED_MESSAGE
            return code, f"error: {error}"
    raise TypeError(f"{type(error).__name__} has no exit code (vldist.exit_codes.EXIT_CODES): {error}")
