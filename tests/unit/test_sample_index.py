"""The sample index of a shard: written with the shard, rebuilt alike from its tar by
`vldist.shards index`, checked by `verify`, refused by name when it no longer fits its shard, and
each sample read by it holds the bytes the shard's stream gives."""

import json
import shutil

import pytest

from vldist.data.sample_index import ShardIndex, index_tar, one_sample, tar_samples
from vldist.data.sample_reader import coalesced, read_spans
from vldist.data.shard_stream import shard_samples
from vldist.data.shardset import ShardSet
from vldist.errors import ShardsUnfitError
from vldist.shards.__main__ import main as shards_main


def _index(path) -> ShardIndex:
    return ShardIndex.from_json((path.parent / f"{path.name}.idx.json").read_text(), str(path))


def _raise(exn):
    raise exn


def test_the_writers_index_equals_one_built_from_the_tar_and_reads_every_sample_as_the_stream(planted_shards):
    for shard in sorted(planted_shards.glob("*.tar")):
        index = _index(shard)
        with shard.open("rb") as f:
            assert index_tar(f, shard.name) == index
        assert index.bytes == shard.stat().st_size
        streamed = list(shard_samples([str(shard)], _raise))
        assert [s["__key__"] for s in streamed] == list(index.keys)
        # every sample alone, and three at once in an order of their own
        spans = [index.span(row) for row in range(len(index))]
        for sample, data in zip(streamed, read_spans(str(shard), spans), strict=True):
            (alone,) = tar_samples(data, str(shard), _raise)
            assert alone == sample and one_sample(data, str(shard)) == sample
        rows = [5, 1, 2]
        got = read_spans(str(shard), [index.span(r) for r in rows])
        assert [next(iter(tar_samples(d, str(shard), _raise)))["__key__"] for d in got] == [index.keys[r] for r in rows]


def test_close_samples_are_read_as_one_range():
    assert coalesced([(100, 200), (0, 50), (60, 90)], gap=9) == [(0, 50), (60, 90), (100, 200)]
    assert coalesced([(100, 200), (0, 50), (60, 90)], gap=10) == [(0, 200)]
    assert coalesced([(0, 50), (0, 50)], gap=0) == [(0, 50)]  # one sample asked twice: read once


def test_the_index_command_indexes_an_old_set_and_verify_finds_an_index_that_does_not_fit(
    planted_shards, tmp_path, capsys
):
    old = tmp_path / "old"
    shutil.copytree(planted_shards, old)
    written = {p.name: p.read_text() for p in old.glob("*.idx.json")}
    for path in old.glob("*.idx.json"):
        path.unlink()
    assert ShardSet.open(old).sample_indexes("train") is None  # trains as before, unindexed
    assert shards_main(["index", str(old)]) == 0
    assert {p.name: p.read_text() for p in old.glob("*.idx.json")} == written
    assert "indexed 7 shards" in capsys.readouterr().out
    assert shards_main(["index", str(old)]) == 0  # rerun: nothing to do
    assert "indexed 0 shards, 7 had an index already" in capsys.readouterr().out

    damaged = old / "train-000001.tar.idx.json"
    data = json.loads(damaged.read_text())
    data["offsets"][2] += 512
    damaged.write_text(json.dumps(data))
    assert shards_main(["verify", str(old)]) == 1
    out = capsys.readouterr().out
    assert "train-000001.tar.idx.json: does not fit train-000001.tar (its offsets differ)" in out
    assert shards_main(["index", str(old), "--force"]) == 0 and shards_main(["verify", str(old)]) == 0


def test_an_index_of_another_version_of_its_shard_or_a_damaged_one_is_refused_by_name(planted_shards, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(planted_shards, changed)
    with (changed / "train-000000.tar").open("ab") as f:
        f.write(b"\0" * 1024)  # rewritten after it was indexed
    with pytest.raises(ShardsUnfitError, match=r"train-000000.tar.idx.json describes a shard of \d+ bytes"):
        ShardSet.open(changed).sample_indexes("train")
    (changed / "train-000000.tar.idx.json").write_text("{not json")
    with pytest.raises(ShardsUnfitError, match="is damaged .*python -m vldist.shards index"):
        ShardSet.open(changed).sample_indexes("train")


def test_the_quick_parser_leaves_extended_headers_to_tarfile_and_refuses_a_damaged_header(tmp_path):
    import io
    import tarfile

    from vldist.data.sample_index import index_tar_members

    path = tmp_path / "train-000000.tar"
    long_key = "k" * 120  # a name over 100 bytes: the writer adds a PAX header for it
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key in ("short", long_key):
            for ext, data in (("json", b'{"captions": ["a"]}'), ("txt", b"hello")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        index = index_tar_members(tar, path.name, path.stat().st_size)
    data = path.read_bytes()
    short, long_ = (data[slice(*index.span(row))] for row in (0, 1))
    assert one_sample(short, "u") == {
        "__key__": "short",
        "__url__": "u",
        "json": b'{"captions": ["a"]}',
        "txt": b"hello",
    }
    assert one_sample(long_, "u") is None  # PAX: tarfile's job
    assert next(iter(tar_samples(long_, "u", _raise)))["__key__"] == long_key
    damaged = bytearray(short)
    damaged[0] ^= 1  # the first header's name: its checksum no longer fits
    with pytest.raises(tarfile.HeaderError, match="bad checksum"):
        one_sample(bytes(damaged), "u")
