"""Shard sets: a deterministic WebDataset writer and the embedded synthetic dataset."""

from .writer import ShardSetWriter

__all__ = ["ShardSetWriter", "build_synth"]


def __getattr__(name):
    # build_synth pulls in torchvision; readers that only need the writer do not pay for it
    if name == "build_synth":
        from .synth import build_synth

        return build_synth
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
