"""A job's shard sets: the sets its streams read, each opened once, and the embedded ones built
only when missing and allowed, in the data home."""

from vldist.data import job_shards
from vldist.data.embedded_home import EmbeddedSet, ensure_built
from vldist.data.job_shards import build_missing, open_job_shards, stream_sets
from vldist.data.streams import StreamSource
from vldist.recipes.jobs import load_config


class TwoSets:
    """A recipe class whose second stream reads another shard set."""

    other = ""

    @classmethod
    def train_streams(cls, config):
        return {"main": "train", "second": StreamSource("train", shards=cls.other), "same": "val"}


def test_stream_sets_name_each_other_set_once(planted_shards, tmp_path):
    config = load_config("vsrn", [f"data.shards={planted_shards}"])
    TwoSets.other = str(tmp_path / "other")
    assert stream_sets(config, TwoSets) == [TwoSets.other]
    TwoSets.other = str(planted_shards)  # the job's own set is not another
    assert stream_sets(config, TwoSets) == []


def test_each_set_is_opened_once_and_found_by_directory(planted_shards, tmp_path, monkeypatch):
    import shutil

    from vldist.data.shardset import ShardSet

    other = tmp_path / "other"
    shutil.copytree(planted_shards, other)
    TwoSets.other = str(other)
    opened = []
    real_open = ShardSet.open.__func__
    monkeypatch.setattr(
        ShardSet, "open", classmethod(lambda cls, d, access=None: opened.append(str(d)) or real_open(cls, d, access))
    )
    shards = open_job_shards(load_config("vsrn", [f"data.shards={planted_shards}"]), TwoSets)
    assert opened == [str(planted_shards), str(other)]
    assert shards.get(None) is shards.main and shards.get(str(other)).directory == other


def test_embedded_sets_are_built_only_when_missing_and_allowed(tmp_path, monkeypatch):
    """In the data home ($VLDIST_DATA_HOME), not in the working directory."""
    built = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLDIST_DATA_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(
        job_shards.EMBEDDED_SETS, "shards/synth", EmbeddedSet("builtins", "print", "a test set", "", "")
    )
    monkeypatch.setattr("builtins.print", lambda directory: built.append(directory))

    class OneSet:
        @classmethod
        def train_streams(cls, config):
            return {"main": "train"}

    build_missing(load_config("vsrn", ["data.build_if_missing=false"]), OneSet)
    assert built == []
    build_missing(load_config("vsrn", []), OneSet)
    assert built == [tmp_path / "home" / "synth"]
    (tmp_path / "home" / "synth").mkdir(parents=True)
    (tmp_path / "home" / "synth" / "manifest.json").write_text("{}")
    build_missing(load_config("vsrn", []), OneSet)
    assert built == [tmp_path / "home" / "synth"]  # there now: not built again
    assert not (tmp_path / "shards").exists()


def _slow_builder(directory) -> None:
    """A stand-in for an embedded set's builder: it counts its calls and takes long enough that
    two processes started together overlap, writing through .partial as the real builders do."""
    import time
    from pathlib import Path

    with open(f"{directory}.calls", "a") as calls:
        calls.write("built\n")
    partial = Path(f"{directory}.partial")
    partial.mkdir()
    time.sleep(1.0)
    (partial / "manifest.json").write_text("{}")
    partial.rename(directory)


def _build_in_process(cwd: str) -> None:
    import os

    os.chdir(cwd)
    os.environ["VLDIST_DATA_HOME"] = os.path.join(cwd, "home")
    job_shards.EMBEDDED_SETS["shards/synth"] = EmbeddedSet(__name__, "_slow_builder", "a test set", "", "")
    ensure_built("shards/synth")


def test_two_processes_building_one_set_build_it_once(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # real processes: a file lock is per process
    processes = [context.Process(target=_build_in_process, args=(str(tmp_path),)) for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0, 0]
    home = tmp_path / "home"
    assert (home / "synth.calls").read_text() == "built\n"
    assert (home / "synth" / "manifest.json").exists()
    assert sorted(p.name for p in home.iterdir()) == ["synth", "synth.calls"]  # no .partial, no lock file left
