"""The errors a command reports in one line instead of a traceback (exit_codes.py maps each to its
exit code). They live here, importing nothing, so that the table of exit codes imports no platform;
the modules that raise them import them from here."""

from __future__ import annotations

from pathlib import Path

# ---------------------------------------------------------------- refused before anything ran


class ConfigError(ValueError):
    """A job file or override is wrong; the message says which key and what is allowed."""


class RecipeContractError(ConfigError):
    """A recipe returned something the platform cannot use; the message names the recipe and what."""


class ShardsNotFoundError(FileNotFoundError):
    """The shard directory or a split in it is missing; the message says how to make it."""


class ShardsUnfitError(ValueError):
    """The shard set lacks what the recipe reads (e.g. region features); the message says how to add it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message says which and what to do."""


class IncompatibleCheckpoint(ValueError):
    """The checkpoint holds another model than the job builds; the message says what differs."""


class OutputNotWritable(OSError):
    """A path the command writes to (output.dir, a checkpoint directory, an export target, a shard
    set's output) cannot be written: a read-only filesystem, no permission, a file where a directory
    should be. The message names the path and the cause, and what to do."""

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno n] ..." form
        return str(self.args[0])


class OutputDirInUse(RuntimeError):
    """Another live run holds the output directory; the message names it (host, pid, command)."""


class RunDirectoryTaken(RuntimeError):
    """The run directory holds a finished run, or a run of other settings; the message says what
    to do instead."""


class CaptionMetricsError(RuntimeError):
    """pycocoevalcap could not compute the metrics (its Java programs failed or are missing)."""


class JavaNotFoundError(CaptionMetricsError):
    """No ``java`` on PATH: pycocoevalcap's tokenizer and METEOR are Java programs."""


class StoreSupportMissing(ImportError):
    """The URL's filesystem package is not installed; the message names the extra."""


class StoreUnreachable(ConnectionError):
    """A store did not answer, or refused, when a shard set was opened; the message says what to check."""


# ---------------------------------------------------------------- failed while it ran


class RunFailed(RuntimeError):
    """The Ray run failed for good (after its restarts); the message holds the workers' error."""


class PeerLost(RuntimeError):
    """This rank's collective failed because another rank of the run is gone."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk); the message names the previous good one."""


class EmptySplitError(RuntimeError):
    """Every sample of an evaluation split was skipped; the message gives the first reasons."""


class TooManySkipped(RuntimeError):
    """More of the training samples were unreadable than data.max_skipped_fraction allows; the
    message names the shards they came from and what to do."""


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; nothing was written after the last good checkpoint."""


class StoreLost(RuntimeError):
    """The store stopped answering during a run: not one shard, the store (the message says which,
    what was tried and what to check). Raised through the loader, it ends the run; the checkpoints
    written before stay whole."""

    def __init__(self, message: str):
        # a loader worker's error reaches the main process as exc_type("Caught ... Original
        # Traceback ...: <message>"): keep the message, not the worker's traceback
        if "Original Traceback" in message:
            message = message.rstrip().rsplit(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)

    def __str__(self) -> str:  # the message alone: WebDataset appends the stream and the URL to args
        return str(self.args[0])


class UnreadableBatch(StoreLost):
    """A rank could read none of a batch's samples: without a batch it would take one step fewer
    than the others and leave them waiting, so the run ends (the message says what to check)."""


class RandomStateMismatch(RuntimeError):
    """train.accumulate_negatives: a micro-batch's forward, re-run from its saved random state,
    gave other embeddings than the cached ones (the message names the likely causes)."""


class ReplicasDiverged(RuntimeError):
    """The ranks' replicas of the model differ; the message names the step, the tensor and the ranks."""


# ---------------------------------------------------------------- stopped on request


class TrainingStopped(Exception):
    """Training stopped on request after writing a checkpoint of the step it reached."""

    def __init__(self, step: int, checkpoint: Path, reason: str):
        self.step, self.checkpoint, self.reason = step, checkpoint, reason
        super().__init__(
            f"stopped by {reason} after step {step}; checkpoint {checkpoint}. "
            "Run the same command with train.resume=auto to carry on from it."
        )


class RunStopped(RuntimeError):
    """The workers stopped on request after a checkpoint; submitting the job again resumes."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a part of the command that is not training (building the embedded data set):
    the message says what was interrupted and what the next run does about it."""
