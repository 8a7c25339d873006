"""`python -m vldist.shards verify <dir>`: re-read every sample of a shard set and report problems.

Checks, against `manifest.json` when there is one: every listed shard exists, has its sha256 and
its sample count; every sample's members decode (`json` with a non-empty `captions` list,
`regions.npy` a finite 2-D array with the manifest's feature size, `jpg`/`png` a readable image;
the same for the named images of pair samples, `img1.jpg`, `img1.regions.npy`);
keys are unique across the set; each shard is a whole tar (one cut short is named with the byte
where it breaks); each shard's sample index, where it has one, fits it (the offsets and keys its
tar headers give); the feature standardisation the manifest names
(`features.standardization`) reads, holds finite values and has the manifest's feature size.
Each problem names the shard and the key (or the file). A set at a URL (s3://...) is checked the
same way, one file at a time downloaded to a temporary directory (vldist/store), so a remote set
needs no local room beyond its largest shard.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vldist.file_integrity import sha256_file
from vldist.shards.format.layout import MANIFEST_NAME


@dataclass
class Report:
    samples: Counter = field(default_factory=Counter)  # per split
    problems: list[str] = field(default_factory=list)

    def problem(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_member(ext: str, data: bytes, feature_dim: int | None) -> str | None:
    """What is wrong with one member, or None."""
    try:
        if ext == "json":
            meta = json.loads(data)
            captions = meta.get("captions")
            if not isinstance(captions, list) or not captions or not all(isinstance(c, str) for c in captions):
                return "json has no non-empty 'captions' list of strings"
        elif ext == "regions.npy" or ext.endswith(".regions.npy"):  # img1.regions.npy: one of a pair
            regions = np.load(io.BytesIO(data), allow_pickle=False)
            if regions.ndim != 2 or regions.shape[0] == 0:
                return f"regions.npy has shape {regions.shape}, expected (R>0, F)"
            if feature_dim is not None and regions.shape[1] != feature_dim:
                return f"regions.npy has {regions.shape[1]} features, the manifest says {feature_dim}"
            if not np.isfinite(regions).all():
                return "regions.npy holds NaN or inf"
        elif ext.rpartition(".")[2] in ("jpg", "jpeg", "png"):
            from PIL import Image

            with Image.open(io.BytesIO(data)) as image:
                image.load()
    except Exception as err:  # noqa: BLE001 - any decode failure is the finding
        return f"{ext} does not decode ({type(err).__name__}: {err})"
    return None


def _read_shard(path: Path, split: str, feature_dim: int | None, keys: Counter, report: Report) -> int:
    """Check every sample of one shard; returns how many samples it holds."""
    samples: dict[str, set[str]] = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, set()).add(ext)
                data = tar.extractfile(member).read()
                problem = _check_member(ext, data, feature_dim)
                if problem:
                    report.problem(f"{path.name} {key}", problem)
    except (tarfile.TarError, OSError, EOFError) as err:
        report.problem(path.name, f"unreadable tar after {len(samples)} samples ({err})")
    for key, exts in samples.items():
        keys[key] += 1
        if "json" not in exts:
            report.problem(f"{path.name} {key}", f"no json member (has {sorted(exts)})")
    report.samples[split] += len(samples)
    return len(samples)


def _check_tar(files: _Files, shard: str, path: Path, report: Report) -> None:
    """Whether the shard is cut short (said with the byte where it breaks), and its sample index,
    if it has one, against the index its tar headers give."""
    from vldist.data.sample_index import ShardIndex, scan_tar
    from vldist.errors import ShardsUnfitError
    from vldist.shards.format.layout import index_name
    from vldist.store.location import redact

    where = redact(files.where)
    try:
        with open(path, "rb") as f:
            actual, cut = scan_tar(f, shard)
    except (ShardsUnfitError, OSError) as err:
        report.problem(shard, str(err))
        return
    if cut is not None:
        report.problem(
            shard,
            f"{cut.what}: {cut.how}; its {len(actual)} whole samples end at byte {cut.at}. Copy or build it again, "
            f"or index just those with `python -m vldist.shards index {where} --partial`",
        )
    name = index_name(shard)
    if name not in files.names:
        return
    try:
        with files.local(name) as index_path:
            index = ShardIndex.from_json(index_path.read_text(), name)
    except (ShardsUnfitError, ValueError, OSError) as err:
        report.problem(name, str(err))
        return
    if index != actual:
        differ = [
            f for f in ("shard", "bytes", "keys", "offsets", "sizes", "cut") if getattr(index, f) != getattr(actual, f)
        ]
        how = "--partial" if cut is not None else "--force"
        report.problem(
            name,
            f"does not fit {shard} (its {', '.join(differ)} differ): rebuild it with "
            f"`python -m vldist.shards index {where} {how}`",
        )


def _check_standardization(files: _Files, features: dict, report: Report) -> None:
    name = features.get("standardization")
    if not name:
        return
    from vldist.shards.format.standardization import load_standardization

    if name not in files.names:
        report.problem(name, "named in manifest.json (features.standardization) but missing")
        return
    try:
        with files.local(name) as path:
            load_standardization(path, features.get("dim"))
    except ValueError as err:
        report.problem(name, str(err))


class _Files:
    """The files of a set by name, each as a local path: the directory's own, or (a URL) each
    downloaded to a temporary directory while it is checked, then removed."""

    def __init__(self, where: str | Path, access=None):
        from vldist.store.access import StoreAccess
        from vldist.store.location import is_url, list_names

        self.remote = is_url(where)
        self.where = str(where).rstrip("/") if self.remote else Path(where)
        self.access = access or StoreAccess()
        listed = list_names(self.where, self.access.storage_options)
        self.names = None if listed is None else set(listed)

    @contextlib.contextmanager
    def local(self, name: str):
        if not self.remote:
            yield self.where / name
            return
        from vldist.store.location import join
        from vldist.store.reader import ResumableReader

        scratch = Path(tempfile.mkdtemp(prefix="vldist-verify-"))
        try:
            with ResumableReader(str(join(self.where, name)), self.access) as source, open(scratch / name, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            yield scratch / name
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def verify(directory: str | Path, access=None) -> Report:
    """Check the set at a local directory or a URL (`access`: a vldist.store StoreAccess for it)."""
    report, keys = Report(), Counter()
    files = _Files(directory, access)
    if files.names is None:
        report.problem(str(directory), "no such directory")
        return report
    if MANIFEST_NAME in files.names:
        with files.local(MANIFEST_NAME) as path:
            manifest = json.loads(path.read_text())
        feature_dim = (manifest.get("features") or {}).get("dim")
        _check_standardization(files, manifest.get("features") or {}, report)
        for split, entry in manifest.get("splits", {}).items():
            for shard in entry.get("shards", []):
                if shard["file"] not in files.names:
                    report.problem(shard["file"], "listed in manifest.json but missing")
                    continue
                with files.local(shard["file"]) as path:
                    if shard.get("sha256") and sha256_file(path) != shard["sha256"]:
                        report.problem(shard["file"], "sha256 differs from manifest.json (changed or damaged)")
                    count = _read_shard(path, split, feature_dim, keys, report)
                    _check_tar(files, shard["file"], path, report)
                if "samples" in shard and count != shard["samples"]:
                    report.problem(shard["file"], f"holds {count} samples, manifest.json says {shard['samples']}")
    else:
        tars = [n for n in sorted(files.names) if n.endswith(".tar") and "-" in n]
        if not tars:
            report.problem(str(directory), "no manifest.json and no <split>-NNNNNN.tar shards")
        for name in tars:
            with files.local(name) as path:
                _read_shard(path, name.rsplit("-", 1)[0], None, keys, report)
                _check_tar(files, name, path, report)
    for key, n in keys.items():
        if n > 1:
            report.problem(key, f"key appears in {n} samples; keys must be unique across the set")
    return report
