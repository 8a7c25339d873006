"""`python -m vldist.train` loads its imports without garbage collection and then freezes them
(vldist/train.py, _startup_imports_frozen); a caller of main(argv) in its own process keeps its
collector as it was, and a failing startup leaves collection on."""

from __future__ import annotations

import gc
import sys

import pytest

from vldist import train


@pytest.fixture
def thawed():
    """Whatever a test freezes goes back to the collected generations after it."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_the_program_collects_nothing_while_importing_then_freezes_what_it_loaded(thawed):
    with train._startup_imports_frozen(program=True):
        assert not gc.isenabled()
        loaded = [object() for _ in range(10)]  # stands in for the imports' objects
    assert gc.isenabled() and gc.get_freeze_count() > len(loaded)


def test_a_caller_in_its_own_process_keeps_its_collector(thawed):
    with train._startup_imports_frozen(program=False):
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert train.main(["vsrn", "train.no_such_key=1"]) == 2  # refused, in this process
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_program_refusing_its_config_still_collects_after(thawed, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vldist.train", "vsrn", "train.no_such_key=1"])
    assert train.main() == 2
    assert "train.no_such_key" in capsys.readouterr().err
    assert gc.isenabled() and gc.get_freeze_count() > 0
