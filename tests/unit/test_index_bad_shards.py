"""`python -m vldist.shards index` on a set with a shard cut short (an interrupted copy): refused in
one line that names the shard and the byte where it breaks, nothing written; with --partial the
whole samples before that byte are indexed and training reads exactly those. The refusal of a
stale index at training names commands that work on such a shard. Shard output that cannot be
written (a read-only disk, a file on the path) is refused in one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import uuid

import fsspec
import pytest
from helpers import SMALL_VSRN, tmpfs_mounted, train_vsrn, write_planted_shards

from vldist.data.sample_index import ShardIndex
from vldist.data.shardset import ShardSet
from vldist.errors import ShardsUnfitError
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config
from vldist.shards.__main__ import main as shards_main

SHARD = "train-000001.tar"  # the second of two train shards of 20 samples


@pytest.fixture(scope="module")
def whole_set(tmp_path_factory):
    return write_planted_shards(tmp_path_factory.mktemp("whole") / "set", {"train": 40, "val": 8, "test": 8}, 20)


def _members(path):
    with tarfile.open(path) as tar:
        return [(m.name, m.offset, m.offset_data) for m in tar]


def _cut_copy(whole_set, tmp_path, where: str, keep_indexes: bool = False):
    """The set with SHARD cut short at `where`: mid-member (inside the 16th sample's json data, 60%
    of the shard, not on a 512-byte boundary) or between the two members of the 16th sample."""
    out = tmp_path / "set"
    shutil.copytree(whole_set, out)
    members = _members(out / SHARD)
    name, start, data = members[30]  # the 16th sample's json
    assert name == "train-0000035.json" and start == 30720
    size = {"mid-member": data + 100, "between-members": members[31][1]}[where]
    assert size % 512 or where == "between-members"
    os.truncate(out / SHARD, size)
    if not keep_indexes:
        for index in out.glob("*.idx.json"):
            index.unlink()
    return out, size


def _index_files(directory):
    return sorted(p.name for p in directory.glob("*.idx.json"))


@pytest.mark.parametrize("where", ["mid-member", "between-members"])
def test_index_refuses_a_shard_cut_short_naming_the_byte_and_writes_nothing(whole_set, tmp_path, capsys, where):
    out, size = _cut_copy(whole_set, tmp_path, where)
    assert shards_main(["index", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    inside = (
        "inside member 'train-0000035.json' that begins at byte 30720"
        if where == "mid-member"
        else "inside the header that begins at byte 31744"
        if size % 512
        else "without tar's end-of-archive block"
    )
    assert err.startswith(f"error: {out / SHARD} is cut short: it ends at byte {size}"), err
    assert inside in err, err
    assert f"`python -m vldist.shards verify {out}` lists every problem" in err
    # the 16th sample (json whole, its regions.npy gone) is not indexed: 15 whole samples
    assert (
        f"`python -m vldist.shards index {out} --partial` indexes its 15 whole samples before byte 30720 "
        "(5 of the manifest's 20 samples of that shard are then left out of training)"
    ) in err
    assert _index_files(out) == []  # not even the whole shards' indexes: refused before anything was written


def test_partial_indexes_the_whole_samples_and_training_reads_exactly_those(whole_set, tmp_path, capsys):
    out, size = _cut_copy(whole_set, tmp_path, "mid-member")
    assert shards_main(["index", str(out), "--partial"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"partial: {SHARD} is cut short (it ends at byte {size}, inside member 'train-0000035.json' that begins "
        "at byte 30720): indexed its 15 whole samples before byte 30720; 5 of the manifest's 20 samples of that "
        "shard are left out of training"
    ) in printed
    assert "indexed 4 shards" in printed
    written = ShardIndex.from_json((out / f"{SHARD}.idx.json").read_text(), SHARD)
    whole = ShardIndex.from_json((whole_set / f"{SHARD}.idx.json").read_text(), SHARD)
    assert written.bytes == size and written.cut == 30720
    assert written.keys == whole.keys[:15] and written.offsets == whole.offsets[:15]
    assert max(o + s for o, s in zip(written.offsets, written.sizes, strict=True)) <= 30720  # only bytes it holds
    assert shards_main(["index", str(out)]) == 0  # rerun: the partial index fits its shard, kept
    assert "indexed 0 shards, 4 had an index already" in capsys.readouterr().out
    assert shards_main(["verify", str(out)]) == 1  # the shard is still named as cut short
    assert f"{SHARD}: cut short: it ends at byte {size}" in capsys.readouterr().out

    from vldist.data.fit_to_job import what_the_job_leaves_out  # here: the tests above need none of it

    config = load_config("vsrn", [f"data.shards={out}"])
    (line,) = what_the_job_leaves_out(config, get_recipe("vsrn")(config, vocab=None), ShardSet.open(out))
    assert line.startswith(
        f"1 train shard of {out} is cut short or damaged and indexed with --partial ({SHARD}): 5 of the "
    )

    # an exact epoch over 35 samples: 7 steps of 5, not one sample skipped (none read past the cut)
    code, err = train_vsrn(
        capsys,
        f"data.shards={out}",
        f"output.dir={tmp_path / 'run'}",
        *SMALL_VSRN,
        "data.batch_size=5",
        "data.resampled=false",
        "data.workers=0",
        "train.epochs=1",
        "train.validate_every=0",
    )
    assert code == 0, err[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 7 and metrics["skipped_samples"] == 0, metrics


def _commands(message: str) -> list[list[str]]:
    """The `python -m vldist.shards ...` commands a message names, as argv for its main()."""
    return [c.split()[3:] for c in re.findall(r"`(python -m vldist\.shards [^`]+)`", message)]


def test_the_stale_index_refusal_names_commands_that_work_on_a_shard_cut_short(whole_set, tmp_path, capsys):
    out, size = _cut_copy(whole_set, tmp_path, "mid-member", keep_indexes=True)  # cut after it was indexed
    with pytest.raises(ShardsUnfitError) as refused:
        ShardSet.open(out).sample_indexes("train")
    message = str(refused.value)
    assert f"describes a shard of 51200 bytes, and the shard has {size}: it was cut short" in message
    verify, index = _commands(message)
    assert verify == ["verify", str(out)] and index == ["index", str(out)]
    assert shards_main(verify) == 1
    assert f"{SHARD}: cut short" in capsys.readouterr().out
    assert shards_main(index) == 2  # the command it names says what the shard is and how to go on
    (partial,) = [c for c in _commands(capsys.readouterr().err) if "--partial" in c]
    assert shards_main(partial) == 0
    assert "1 replacing an index that no longer fit its shard" in capsys.readouterr().out
    assert [len(i) for i in ShardSet.open(out).sample_indexes("train")] == [20, 15]


def test_a_set_at_a_url_is_scanned_front_to_back_alike(whole_set, tmp_path, capsys):
    """The store's path (fsspec's in-memory filesystem; S3 and HTTP read through the same reader)."""
    out, size = _cut_copy(whole_set, tmp_path, "mid-member")
    memory, root = fsspec.filesystem("memory"), f"/cut-{uuid.uuid4().hex}"
    for path in out.iterdir():
        memory.pipe_file(f"{root}/{path.name}", path.read_bytes())
    url = f"memory://{root}"
    try:
        assert shards_main(["index", url]) == 2
        err = capsys.readouterr().err
        assert f"{url}/{SHARD} is cut short: it ends at byte {size}, inside member 'train-0000035.json'" in err
        assert "indexes its 15 whole samples before byte 30720" in err and not memory.glob(f"{root}/*.idx.json")
        assert shards_main(["index", url, "--partial"]) == 0
        remote = ShardIndex.from_json(memory.cat_file(f"{root}/{SHARD}.idx.json"), SHARD)
        assert shards_main(["index", str(out), "--partial"]) == 0
        assert remote == ShardIndex.from_json((out / f"{SHARD}.idx.json").read_text(), SHARD)
    finally:
        memory.rm(root, recursive=True)


# ------------------------------------------------------------------------ output that cannot be written


def test_shard_output_under_a_file_is_refused_in_one_line(whole_set, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    (tmp_path / "src" / "train").mkdir(parents=True)
    for argv in (
        ["synth", "--out", str(afile / "x"), "--train", "2", "--val", "1", "--test", "1", "--quiet"],
        ["convert", "folder", "--src", str(tmp_path / "src"), "--out", str(afile / "x"), "--quiet"],
    ):
        assert shards_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: cannot write to --out {afile / 'x'}: {afile} is a file, not a directory. "
            f"Choose another --out DIR or move {afile} out of the way"
        ), err
    assert afile.read_text() == "not a directory"


@pytest.fixture
def read_only_disk(tmp_path):
    """A tiny tmpfs, made read-only by the test once it holds a set (chmod does not stop root)."""
    with tmpfs_mounted(tmp_path / "ro") as disk:
        yield disk


def test_shard_output_on_a_read_only_disk_is_refused_in_one_line(whole_set, read_only_disk, tmp_path, capsys):
    shutil.copytree(whole_set, read_only_disk / "set", ignore=shutil.ignore_patterns("*.idx.json"))
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_disk)], check=True)
    (tmp_path / "src" / "train").mkdir(parents=True)
    for argv in (
        ["synth", "--out", str(read_only_disk / "x"), "--train", "2", "--val", "1", "--test", "1", "--quiet"],
        ["convert", "folder", "--src", str(tmp_path / "src"), "--out", str(read_only_disk / "x"), "--quiet"],
    ):
        assert shards_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: cannot write to --out {read_only_disk / 'x'}: Read-only file system. "
            "Choose another --out DIR or make it writable"
        ), err
        assert not (read_only_disk / "x").exists()
    assert shards_main(["index", str(read_only_disk / "set")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: cannot write the sample index {read_only_disk / 'set' / 'train-000000.tar.idx.json'}: "
        "Read-only file system; no index was written."
    ), err
    assert len(err.splitlines()) == 1 and not list((read_only_disk / "set").glob("*.idx.json"))
