"""File helpers shared by checkpoints, shard sets and telemetry: checksums and atomic JSON."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON to `path` via a temporary file and os.replace, so readers never see half of it."""
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and os.replace, so readers never see half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
