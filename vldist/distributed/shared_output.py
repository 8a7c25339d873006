"""Whether every rank sees the same output directory, checked when a run starts.

Ranks on several nodes write one run: rank 0 commits each checkpoint, every rank resumes from it,
and DeepSpeed and sharded checkpoints hold a file per rank. Where the nodes do not share
`output.dir`, a rank elsewhere would write its part where rank 0 never sees it, or resume from
nothing while rank 0 resumes from step N: the run would diverge or hang much later. The one case
that works is the plain format (rank 0 writes every file) with `output.checkpoint_dir` in a store,
which is then what the nodes share (a node that lacks a checkpoint downloads it)."""

from __future__ import annotations

import logging
import secrets
import socket
from pathlib import Path

from vldist.config import JobConfig
from vldist.distributed.collectives import gather_objects
from vldist.errors import ConfigError

log = logging.getLogger("vldist.train")


def check_output_shared(engine, config: JobConfig) -> None:
    """Collective. Rank 0 leaves a probe file in the output directory; every rank looks for it.
    Ranks that do not see it are refused (ConfigError on every rank) unless the store carries the
    checkpoints between nodes."""
    if engine.world_size == 1:
        return
    out = Path(config.output_dir)
    token = None
    if engine.is_main:
        token = secrets.token_hex(8)
        (out / f".probe-{token}").write_text("written by rank 0 to see which ranks share this directory\n")
    token = gather_objects(token)[0]
    probe = out / f".probe-{token}"
    seen = gather_objects((probe.is_file(), engine.rank, socket.gethostname()))  # every rank has looked
    if engine.is_main:
        probe.unlink(missing_ok=True)
    apart = [(rank, host) for present, rank, host in seen if not present]
    if not apart:
        return
    where = ", ".join(f"rank {rank} on {host}" for rank, host in apart)
    if (
        config.output.checkpoint_dir
        and config.engine.backend in ("accelerate", "fsdp")
        and config.train.checkpoint_format == "plain"
    ):
        if engine.is_main:
            log.info("%s keep their own %s; checkpoints reach them through output.checkpoint_dir", where, out)
        return
    why = (
        "engine.backend=deepspeed writes a part of every checkpoint on each rank"
        if config.engine.backend == "deepspeed"
        else "train.checkpoint_format=sharded writes a part of every checkpoint on each rank"
        if config.train.checkpoint_format == "sharded"
        else "without output.checkpoint_dir a rank there would resume from nothing while rank 0 resumes"
    )
    raise ConfigError(
        f"output.dir {out} is not one directory for every rank: {where} {'does' if len(apart) == 1 else 'do'} "
        f"not see what rank 0 on {seen[0][2]} wrote there, and {why}. Put output.dir on a filesystem every node shares, or "
        "(plain checkpoints under Accelerate or FSDP2) set output.checkpoint_dir to a store URL (s3://...) that "
        "carries the checkpoints between nodes"
    )
