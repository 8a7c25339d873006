"""Shard sets: their format (`format/`), the embedded synthetic sets (`synthetic/`), CNN region
features (`features/`), converters of public datasets (`convert/`), and the
`python -m vldist.shards` command line (`__main__.py`)."""

from vldist.shards.format.writer import ShardSetWriter

__all__ = ["ShardSetWriter", "build_synth"]


def __getattr__(name):
    # build_synth pulls in torchvision; readers that only need the writer do not pay for it
    if name == "build_synth":
        from vldist.shards.synthetic.synth import build_synth

        return build_synth
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
