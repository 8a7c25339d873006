"""A shard set on disk: its manifest, the shard files of each split, and its vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vldist.data.vocab import Vocab


class ShardsNotFoundError(FileNotFoundError):
    """The shard directory or a split in it is missing; the message says how to make it."""


def _how_to_build(directory: Path) -> str:
    return (
        f"Build the embedded dataset with `python -m vldist.shards synth --out {directory}`, "
        "or set data.shards=<dir> to a shard set you converted (see shards/README.md)."
    )


@dataclass
class ShardSet:
    directory: Path
    manifest: dict

    @classmethod
    def open(cls, directory: str | Path) -> "ShardSet":
        directory = Path(directory)
        if not directory.is_dir():
            raise ShardsNotFoundError(f"shard directory '{directory}' does not exist. {_how_to_build(directory)}")
        manifest_path = directory / "manifest.json"
        manifest = {}
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text())
            except ValueError as err:
                raise ValueError(f"{manifest_path} is not valid JSON ({err}); rebuild or fix the shard set") from err
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
        return self.manifest.get("splits", {}).get(split, {}).get("samples")

    def feature_dim(self) -> int | None:
        return self.manifest.get("features", {}).get("dim")

    def vocab(self, cache_dir: Path) -> Vocab:
        """The set's vocab.json, else one built from the train captions and cached in `cache_dir`."""
        for path in (self.directory / "vocab.json", cache_dir / "vocab.json"):
            if path.is_file():
                return Vocab.load(path)
        vocab = Vocab.build(self._train_captions())
        cache_dir.mkdir(parents=True, exist_ok=True)
        vocab.save(cache_dir / "vocab.json")
        return vocab

    def _train_captions(self):
        import webdataset as wds

        from vldist.data.skips import skipped

        samples = wds.tarfile_samples(
            ({"url": u} for u in self.urls("train")), handler=skipped, select_files=lambda n: n.endswith(".json")
        )
        for sample in samples:
            yield from json.loads(sample["json"]).get("captions", [])
