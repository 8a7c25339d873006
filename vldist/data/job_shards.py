"""A job's shard sets, each opened once: data.shards and the sets its other training streams read
(L2C: single-image captions), the embedded sets built on first use."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from vldist.config import DataConfig
from vldist.data.shardset import ShardSet
from vldist.data.streams import stream_sources
from vldist.store.access import StoreAccess

log = logging.getLogger("vldist.train")

SYNTH_DIR = DataConfig.model_fields["shards"].default  # shards/synth
PAIRS_DIR = "shards/synth_pairs"
# The embedded sets vldist generates itself, by their default directory: built on first use.
EMBEDDED_SETS = {
    SYNTH_DIR: ("vldist.shards.synthetic.synth", "build_synth", "the embedded synthetic dataset"),
    PAIRS_DIR: ("vldist.shards.synthetic.pairs", "build_synth_pairs", "the embedded image-pair dataset (L2C)"),
}


def stream_sets(config, recipe_cls) -> list[str]:
    """Shard sets other than data.shards that the job's training streams read (data.sources too)."""
    sources = stream_sources(recipe_cls.train_streams(config)).values()
    sets = [s.shards for s in sources if s.shards] + [s.shards for s in config.data.sources]
    return list(dict.fromkeys(d for d in sets if d != config.data.shards))


def built_where_read(directory: str, build_if_missing: bool) -> bool:
    """An embedded set's own name (shards/synth, relative) that the job builds when absent: each
    process resolves it in its working directory, and each node's first rank builds it there."""
    return directory in EMBEDDED_SETS and build_if_missing


def build_missing(config, recipe_cls) -> None:
    """Build the embedded sets the job reads that are not there yet (data.build_if_missing)."""
    for directory in [config.data.shards, *stream_sets(config, recipe_cls)]:
        if built_where_read(directory, config.data.build_if_missing) and not Path(directory).exists():
            build_embedded(directory)


def build_embedded(directory: str) -> None:
    """Build one embedded set unless another process has: two jobs started at once in one
    directory (two benches, a job beside the tests) would otherwise write the same .partial files."""
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{directory}.lock"):
        if Path(directory).exists():  # built while this process waited for the lock
            return
        module, builder, what = EMBEDDED_SETS[directory]
        log.info("shards '%s' not found: building %s (once, about a minute)", directory, what)
        getattr(importlib.import_module(module), builder)(directory)


@dataclass
class JobShards:
    """The job's shard set (`main`) and the other sets its streams read, by directory."""

    main: ShardSet
    others: dict[str, ShardSet] = field(default_factory=dict)

    def get(self, directory: str | None) -> ShardSet:
        """The set at `directory` (None or data.shards: the main one)."""
        if directory is None or directory not in self.others:
            return self.main
        return self.others[directory]


def open_job_shards(config, recipe_cls) -> JobShards:
    """Open the job's shard sets, once each (build the embedded ones first with build_missing)."""
    access = StoreAccess.of(config.data)
    return JobShards(
        ShardSet.open(config.data.shards, access),
        {d: ShardSet.open(d, access) for d in stream_sets(config, recipe_cls)},
    )
