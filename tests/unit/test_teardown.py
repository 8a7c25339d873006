"""release_process_groups() frees only what a process had: no collection where no engine saw a
process group (a one-process run of Accelerate), the scan for device meshes only where an engine
made them, and that scan, by type, finds every mesh and its subclasses' and clears their groups.
(That a rank's gloo threads are joined before its teardown: tests/integration/test_clean_exit.py.)"""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from vldist.distributed import teardown


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """The calls of gc.collect() made by teardown, counted (and not made)."""
    calls: list[int] = []
    monkeypatch.setattr(teardown.gc, "collect", lambda *args: calls.append(1) or 0)
    monkeypatch.setattr(teardown, "_groups_made", False)
    monkeypatch.setattr(teardown, "_meshes", False)
    monkeypatch.setattr(teardown, "_at_exit", True)  # nothing registered at this test process's exit
    return calls


def test_a_process_that_never_had_a_group_releases_nothing(collections):
    assert not dist.is_initialized()
    teardown.release_process_groups_at_exit()  # as an engine made without a group
    teardown.release_process_groups()
    assert collections == [] and teardown._groups_made is False


def test_a_process_that_had_a_group_collects_at_every_release(collections):
    teardown._groups_made = True  # as noted by an engine made on a group, since destroyed
    teardown.release_process_groups()
    teardown.release_process_groups()  # at exit, again: close() may not have freed everything
    assert collections == [1, 1]


class FakeMesh:
    """Stands in for torch's DeviceMesh: the scan reads only its type and its `_pg_registry`."""

    def __init__(self):
        self._pg_registry = {"shard": object()}


class FakeSubMesh(FakeMesh):
    pass


def test_the_mesh_scan_runs_only_after_an_engine_made_meshes_and_clears_every_mesh(collections, monkeypatch):
    import torch.distributed.device_mesh  # noqa: F401 - the module the scan looks the class up in

    monkeypatch.setattr(sys.modules["torch.distributed.device_mesh"], "DeviceMesh", FakeMesh)
    meshes, other = [FakeMesh(), FakeSubMesh()], type("NotAMesh", (), {"_pg_registry": {"x": 1}})()
    teardown._groups_made = True
    teardown.release_process_groups()
    assert all(mesh._pg_registry for mesh in meshes)  # no engine made meshes: no scan

    teardown.release_process_groups_at_exit(meshes=True)  # as the FSDP2 engine does
    teardown.release_process_groups()
    assert [mesh._pg_registry for mesh in meshes] == [{}, {}] and other._pg_registry == {"x": 1}
    assert collections == [1, 1]
