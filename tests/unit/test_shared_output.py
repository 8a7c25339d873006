"""The start-of-run check that every rank sees one output directory (distributed/shared_output.py):
which runs may go on when a node has its own directory. What each rank saw is given here (one
process); the real check across two nodes: tests/integration/test_multinode.py."""

from types import SimpleNamespace

import pytest

from vldist.distributed import shared_output
from vldist.errors import ConfigError
from vldist.recipes.jobs import load_config


def _check(tmp_path, monkeypatch, overrides, rank1_sees: bool):
    config = load_config("vsrn", [f"output.dir={tmp_path}", *overrides])
    calls = []

    def gather(obj):  # rank 0 is this process; rank 1 answers as told
        calls.append(obj)
        if len(calls) == 1:
            return [obj, None]
        return [obj, (rank1_sees, 1, "node1")]

    monkeypatch.setattr(shared_output, "gather_objects", gather)
    shared_output.check_output_shared(SimpleNamespace(world_size=2, is_main=True, rank=0), config)
    assert calls[1][0] is True  # rank 0 saw its own probe ...
    assert not list(tmp_path.glob(".probe-*"))  # ... and removed it


def test_ranks_that_share_the_directory_go_on(tmp_path, monkeypatch):
    _check(tmp_path, monkeypatch, [], rank1_sees=True)


def test_a_node_of_its_own_goes_on_only_with_plain_checkpoints_in_a_store(tmp_path, monkeypatch):
    _check(tmp_path, monkeypatch, ["output.checkpoint_dir=s3://bucket/run"], rank1_sees=False)
    refusals = {
        (): "without output.checkpoint_dir a rank there would resume from nothing",
        ("output.checkpoint_dir=s3://bucket/run", "engine.backend=deepspeed"): "engine.backend=deepspeed writes a part",
        (
            "output.checkpoint_dir=s3://bucket/run",
            "train.checkpoint_format=sharded",
        ): "checkpoint_format=sharded writes",
    }
    for overrides, why in refusals.items():
        with pytest.raises(ConfigError, match=f"rank 1 on node1 does not see .*{why}.*set output.checkpoint_dir"):
            _check(tmp_path, monkeypatch, list(overrides), rank1_sees=False)
