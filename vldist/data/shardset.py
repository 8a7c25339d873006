"""A shard set on disk: its manifest, the shard files of each split, and its vocabulary."""

from __future__ import annotations

import io
import itertools
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vldist.data.vocab import Vocab
from vldist.shards.format.layout import MANIFEST_NAME, VOCAB_NAME


class ShardsNotFoundError(FileNotFoundError):
    """The shard directory or a split in it is missing; the message says how to make it."""


class ShardsUnfitError(ValueError):
    """The shard set lacks what the recipe reads (e.g. region features); the message says how to add it."""


def _how_to_build(directory: Path) -> str:
    return (
        f"Build the embedded dataset with `python -m vldist.shards synth --out {directory}`, "
        "or set data.shards=<dir> to a shard set you converted (see shards/README.md)."
    )


@dataclass
class ShardSet:
    directory: Path
    manifest: dict
    _counted: dict[str, int] = field(default_factory=dict, repr=False)  # splits counted without a manifest

    @classmethod
    def open(cls, directory: str | Path) -> "ShardSet":
        directory = Path(directory)
        if not directory.is_dir():
            raise ShardsNotFoundError(f"shard directory '{directory}' does not exist. {_how_to_build(directory)}")
        manifest_path = directory / MANIFEST_NAME
        manifest = {}
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text())
            except ValueError as err:
                raise ShardsUnfitError(f"{manifest_path} is not valid JSON ({err}); rebuild or fix the shard set") from err
        return cls(directory, manifest)

    def urls(self, split: str) -> list[str]:
        """Shard files of a split: from the manifest, else every `<split>-*.tar` in the directory."""
        listed = self.manifest.get("splits", {}).get(split, {}).get("shards")
        paths = [self.directory / s["file"] for s in listed] if listed else sorted(self.directory.glob(f"{split}-*.tar"))
        if not paths:
            raise ShardsNotFoundError(
                f"no shards for split '{split}' in '{self.directory}' (expected files {split}-000000.tar ...). "
                + _how_to_build(self.directory)
            )
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ShardsNotFoundError(f"shards listed in the manifest are missing: {', '.join(missing)}")
        return [str(p) for p in paths]

    def num_samples(self, split: str) -> int | None:
        """From the manifest; without one, counted from the tar headers (shards from other tools)."""
        listed = self.manifest.get("splits", {}).get(split, {}).get("samples")
        if listed is not None or self.manifest.get("splits"):
            return listed
        if split not in self._counted:  # a scan of every header: once per split, not per evaluation
            keys = set()
            for url in self.urls(split):
                with tarfile.open(url) as tar:
                    keys.update((url, m.name.partition(".")[0]) for m in tar if m.isfile())
            self._counted[split] = len(keys)
        return self._counted[split]

    def feature_dim(self) -> int | None:
        """From the manifest; without one, the width of the first train sample's regions.npy."""
        dim = self.manifest.get("features", {}).get("dim")
        if dim is not None or self.manifest:
            return dim
        for url in self.urls("train"):
            with tarfile.open(url) as tar:
                for member in tar:
                    if member.name.endswith(".regions.npy"):
                        regions = np.load(io.BytesIO(tar.extractfile(member).read()), allow_pickle=False)
                        return int(regions.shape[1]) if regions.ndim == 2 else None
        return None

    def vocab(self, cache_dir: Path, min_count: int = 1, also: tuple["ShardSet", ...] = ()) -> Vocab:
        """The set's vocab.json, else one built from the train captions and cached in `cache_dir`.
        With `min_count` > 1 (words seen fewer times become <unk>, as captioning papers do) it is
        always built from the train captions: vocab.json keeps no counts. `also`: other sets a job
        trains on (L2C's single-image captions), whose train captions join the vocabulary."""
        own = [self.directory / VOCAB_NAME] if min_count == 1 and not also else []
        name = "vocab" + (f"-min{min_count}" if min_count > 1 else "") + ("-streams" if also else "")
        cached = cache_dir / (name + ".json")
        for path in (*own, cached):
            if path.is_file():
                try:
                    return Vocab.load(path)
                except ValueError as err:
                    raise ShardsUnfitError(str(err)) from None
        vocab = Vocab.build(itertools.chain(self.train_captions(), *(other.train_captions() for other in also)),
                            min_count)
        cache_dir.mkdir(parents=True, exist_ok=True)
        vocab.save(cached)
        return vocab

    def train_captions(self):
        """Every caption of the train split, in shard order (read from the JSON members only)."""
        import webdataset as wds

        from vldist.data.skips import skipped

        samples = wds.tarfile_samples(
            ({"url": u} for u in self.urls("train")), handler=skipped, select_files=lambda n: n.endswith(".json")
        )
        for sample in samples:
            yield from json.loads(sample["json"]).get("captions", [])
