"""A shard set at a URL reads as the same set on disk: manifest, shard list, counts, vocabulary and
every sample's bytes, through fsspec (its in-memory filesystem here; a real HTTP server in
tests/integration/test_remote_shards.py). URLs never pass through pathlib, credentials never reach
a message or the configuration, and a missing filesystem package names the extra to install."""

from __future__ import annotations

import sys
from pathlib import Path

import fsspec
import pytest

from vldist.data.shard_stream import shard_samples
from vldist.data.shardset import ShardSet
from vldist.data.skips import skipped
from vldist.errors import ShardsNotFoundError, StoreSupportMissing
from vldist.shards.format.layout import MANIFEST_NAME
from vldist.store.location import filesystem, is_url, join, redact


@pytest.fixture
def remote_copy(planted_shards):
    """The planted set copied into fsspec's in-memory filesystem, under a name of this test's own."""
    memory = fsspec.filesystem("memory")
    root = f"/sets/{id(object())}"
    for path in Path(planted_shards).iterdir():
        memory.pipe_file(f"{root}/{path.name}", path.read_bytes())
    yield f"memory://{root}"
    memory.rm(root, recursive=True)


def test_urls_and_paths_are_kept_apart():
    assert is_url("s3://bucket/set") and is_url("https://host/set") and is_url("memory://x")
    assert not is_url("shards/synth") and not is_url(Path("s3:/b")) and not is_url("C:\\data")
    assert join("s3://bucket/set/", "train-000000.tar") == "s3://bucket/set/train-000000.tar"
    assert join("shards/synth", "manifest.json") == Path("shards/synth/manifest.json")


def test_messages_show_urls_without_credentials():
    assert redact("https://user:pa55@host:8080/sets/a?X-Amz-Signature=abc") == "https://host:8080/sets/a"
    assert redact("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact("memory:///sets/a") == "memory:///sets/a"
    assert redact(Path("shards/synth")) == "shards/synth"


def _without_s3fs(monkeypatch):
    """As if s3fs were not installed, even where an earlier test imported it (fsspec keeps the class)."""
    registry = sys.modules["fsspec.registry"]  # the module (fsspec.registry the attribute is its mapping)

    monkeypatch.setitem(sys.modules, "s3fs", None)
    for protocol in ("s3", "s3a"):
        monkeypatch.delitem(registry._registry, protocol, raising=False)


def test_a_missing_filesystem_package_names_the_extra(monkeypatch):
    _without_s3fs(monkeypatch)
    with pytest.raises(StoreSupportMissing, match=r'pip install "vldist\[s3\]"'):
        filesystem("s3://bucket/set")


def test_a_job_on_a_url_without_its_filesystem_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    from vldist.train import main as train_main

    _without_s3fs(monkeypatch)
    assert train_main(["vsrn", "data.shards=s3://bucket/set", f"output.dir={tmp_path}", "metrics.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "error: reading s3://bucket/set needs s3:// support" in err and 'pip install "vldist[s3]"' in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "override",
    [
        "data.storage_options={secret: abc}",
        "data.storage_options={client_kwargs: {aws_secret_access_key: abc}}",
        "data.storage_options={headers: {Authorization: Bearer abc}}",
        "data.shards=https://user:abc@host/set",
        "data.shards=https://host/set?X-Amz-Signature=abc",
    ],
)
def test_credentials_in_the_configuration_are_refused(override):
    from vldist.errors import ConfigError
    from vldist.recipes.jobs import load_config

    with pytest.raises(ConfigError, match="environment") as raised:
        load_config("vsrn", [override])
    assert "abc" not in str(raised.value)


def test_other_storage_options_are_kept():
    from vldist.recipes.jobs import load_config

    config = load_config("vsrn", ["data.shards=s3://bucket/set", "data.storage_options={endpoint_url: http://x:1}"])
    assert (config.data.shards, config.data.storage_options) == ("s3://bucket/set", {"endpoint_url": "http://x:1"})


def test_a_remote_set_reads_as_the_local_one(planted_shards, remote_copy, tmp_path):
    local, remote = ShardSet.open(planted_shards), ShardSet.open(remote_copy)
    assert remote.manifest == local.manifest
    for split in ("train", "val", "test"):
        assert [Path(u).name for u in local.urls(split)] == [u.rsplit("/", 1)[1] for u in remote.urls(split)]
        assert all(u.startswith(remote_copy + "/") for u in remote.urls(split))
        assert remote.num_samples(split) == local.num_samples(split)
    assert remote.feature_dim() == local.feature_dim()
    assert remote.vocab(tmp_path / "r").itos == local.vocab(tmp_path / "l").itos
    assert list(remote.train_captions()) == list(local.train_captions())

    def samples(shards):
        return [{k: v for k, v in s.items() if k != "__url__"} for s in shard_samples(shards.urls("val"), skipped)]

    assert samples(remote) == samples(local) and len(samples(local)) == local.num_samples("val")


def test_a_remote_set_without_manifest_is_listed_and_counted(planted_shards, remote_copy):
    fsspec.filesystem("memory").rm(remote_copy.removeprefix("memory://") + "/" + MANIFEST_NAME)
    remote, local = ShardSet.open(remote_copy), ShardSet.open(planted_shards)
    assert remote.manifest == {}
    assert len(remote.urls("train")) == len(local.urls("train"))
    assert remote.num_samples("train") == local.num_samples("train") > 0
    assert remote.feature_dim() == local.feature_dim()


def test_a_missing_remote_set_or_shard_says_which(remote_copy):
    with pytest.raises(ShardsNotFoundError, match="memory://nowhere/set' does not exist"):
        ShardSet.open("memory://nowhere/set")
    shards = ShardSet.open(remote_copy)
    first = f"{remote_copy}/{shards.manifest['splits']['test']['shards'][0]['file']}"
    fsspec.filesystem("memory").rm(first.removeprefix("memory://"))  # gone before the set is opened (and listed)
    with pytest.raises(ShardsNotFoundError, match="missing: " + first):
        ShardSet.open(remote_copy).urls("test")


def test_ray_workers_get_absolute_paths_and_urls_unchanged():
    from vldist.launch.ray_train import absolute

    assert absolute("s3://bucket/set") == "s3://bucket/set"
    assert absolute("shards/synth") == str(Path("shards/synth").resolve())
