"""A job's shard sets, each opened once: data.shards and the sets its other training streams read
(L2C: single-image captions), the embedded sets built on first use (where: embedded_home.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vldist.config import DataConfig
from vldist.data.embedded_home import EMBEDDED_SETS, built_where_read, ensure_built, read_location
from vldist.data.shardset import ShardSet
from vldist.data.streams import stream_sources
from vldist.store.access import StoreAccess

SYNTH_DIR = DataConfig.model_fields["shards"].default  # shards/synth: the embedded sets by the names jobs give them
PAIRS_DIR = "shards/synth_pairs"
__all__ = ["EMBEDDED_SETS", "JobShards", "build_missing", "built_where_read", "open_job_shards", "stream_sets"]


def stream_sets(config, recipe_cls) -> list[str]:
    """Shard sets other than data.shards that the job's training streams read (data.sources too)."""
    sources = stream_sources(recipe_cls.train_streams(config)).values()
    sets = [s.shards for s in sources if s.shards] + [s.shards for s in config.data.sources]
    return list(dict.fromkeys(d for d in sets if d != config.data.shards))


def build_missing(config, recipe_cls) -> None:
    """Build the embedded sets the job reads that are not there yet (data.build_if_missing), each in
    this machine's data home (embedded_home.py)."""
    for directory in [config.data.shards, *stream_sets(config, recipe_cls)]:
        if built_where_read(directory, config.data.build_if_missing):
            ensure_built(directory)


@dataclass
class JobShards:
    """The job's shard set (`main`) and the other sets its streams read, by the directory the job
    names (an embedded set by its name, shards/synth, wherever it was read from)."""

    main: ShardSet
    others: dict[str, ShardSet] = field(default_factory=dict)

    def get(self, directory: str | None) -> ShardSet:
        """The set at `directory` (None or data.shards: the main one)."""
        if directory is None or directory not in self.others:
            return self.main
        return self.others[directory]


def open_job_shards(config, recipe_cls) -> JobShards:
    """Open the job's shard sets, once each (build the embedded ones first with build_missing)."""
    access, build = StoreAccess.of(config.data), config.data.build_if_missing
    return JobShards(
        ShardSet.open(read_location(config.data.shards, build), access),
        {d: ShardSet.open(read_location(d, build), access) for d in stream_sets(config, recipe_cls)},
    )
