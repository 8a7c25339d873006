"""What the embedded sets (synth and synth-pairs) share in how they are built: the three splits,
one reproducible random stream per split, sample keys, JPEG bytes, and writing a set into
`<out>.partial/`, renamed to `<out>` only when complete, so that an interrupted build never looks
finished (and its leftovers are removed by the next build)."""

from __future__ import annotations

import io
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from vldist.shards.format.layout import MANIFEST_NAME, STANDARDIZATION_NAME, VOCAB_NAME
from vldist.shards.synthetic.scenes import Scene

SPLITS = ("train", "val", "test")
JPEG_QUALITY = 90
# What a shard-set directory may hold; --overwrite deletes nothing else.
_SET_NAMES = "|".join(re.escape(name) for name in (MANIFEST_NAME, VOCAB_NAME, STANDARDIZATION_NAME))
_SET_FILE = re.compile(r"^([A-Za-z0-9_]+-\d{6}\.tar(\.idx\.json)?|" + _SET_NAMES + r")(\.tmp)?$")


def split_rng(stream: str, seed: int, split: str) -> random.Random:
    """Independent, reproducible stream per set and split (str seeds are hashed with SHA-512, not
    hash()); `stream` names the set's streams ("vldist-synth"), so two sets of one seed differ."""
    return random.Random(f"{stream}:{seed}:{split}")


def sample_key(split: str, index: int) -> str:
    return f"{split}-{index:07d}"


def jpeg_bytes(scene: Scene) -> bytes:
    buf = io.BytesIO()
    scene.image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def check_counts(counts: dict[str, int]) -> None:
    if counts["train"] < 1 or counts["val"] < 0 or counts["test"] < 0:
        raise ValueError(f"need n_train >= 1 and n_val, n_test >= 0, got {counts}")


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse to build over an existing set (unless overwrite) or over unrelated files (ever)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    foreign = [name for name in entries if not _SET_FILE.match(name)]
    if foreign:
        raise FileExistsError(
            f"{out} holds files that are not part of a shard set ({', '.join(foreign[:5])}); "
            "it is left alone even with --overwrite: choose another --out or empty it yourself"
        )
    if not overwrite:
        what = "a shard set" if MANIFEST_NAME in entries else "an unfinished shard set (no manifest.json)"
        raise FileExistsError(
            f"{out} already holds {what}; pass --overwrite (overwrite=True) to replace it, or choose another --out"
        )


@contextmanager
def building(out_dir, overwrite: bool):
    """Where a new set is written: `<out>.partial`, renamed to `out` when the block ends, removed
    if it raises (so a set that is there is always complete)."""
    out = Path(out_dir)
    check_target(out, overwrite)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():  # left by an interrupted build
        shutil.rmtree(partial)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _install(partial, out)


def _install(partial: Path, out: Path) -> None:
    """Move the finished build to `out`, replacing what check_target allowed to be replaced."""
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
