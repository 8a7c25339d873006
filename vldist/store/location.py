"""A shard set's location: a local path, or a URL read through fsspec.

fsspec does the reading (s3fs, gcsfs, its own HTTP filesystem); this module only keeps URLs and
paths apart (pathlib turns 's3://bucket/set' into 's3:/bucket/set'), strips credentials from every
URL it names in a message, and turns a missing filesystem package into the extra to install."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vldist.errors import StoreSupportMissing, StoreUnreachable

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")  # two letters at least: 'C:\' is a Windows path
# the pip extra (pyproject.toml) that installs each scheme's fsspec filesystem
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


def unreachable(where: str, error: BaseException) -> StoreUnreachable:
    """The error for a store that failed to answer about `where`, naming what to check."""
    return StoreUnreachable(
        f"cannot read {redact(where)}: {type(error).__name__}: {error}. Check the address and that the store is up "
        "(S3: AWS_ENDPOINT_URL or data.storage_options.endpoint_url), the network from this machine, and the "
        "credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; GOOGLE_APPLICATION_CREDENTIALS)"
    )


def is_url(where: str | Path) -> bool:
    """A URL (scheme://...) rather than a local path; file:// counts as a URL too."""
    return isinstance(where, str) and bool(_SCHEME.match(where))


def redact(where: str | Path) -> str:
    """The location as messages may show it: a URL without user:password@ and without its query
    (where signed URLs carry their signature)."""
    if not is_url(where):
        return str(where)
    parts = urlsplit(str(where))
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"  # not urlunsplit: it drops the // of memory:///x


def join(base: str | Path, *names: str) -> str | Path:
    """A path or URL inside `base`, of the same kind."""
    if is_url(base):
        return posixpath.join(str(base).rstrip("/"), *names)
    return Path(base).joinpath(*names)


def list_names(where: str | Path, storage_options: dict[str, Any] | None = None) -> dict[str, int | None] | None:
    """{name: size} of the files directly in a local directory or under a URL (one listing request;
    sizes are None where a store does not say, as HTTP indexes); None when there is no such directory.
    A store that fails to answer raises its own error (callers say what to check: unreachable())."""
    if not is_url(where):
        where = Path(where)
        if not where.is_dir():
            return None
        return {p.name: p.stat().st_size for p in where.iterdir() if p.is_file()}
    fs, path = filesystem(str(where), storage_options)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return None
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries if e.get("type") != "directory"}


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """(fsspec filesystem, path inside it) for a URL. fsspec caches instances per process and
    builds new ones after a fork, so loader workers call this themselves."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as err:
        scheme = urlsplit(url).scheme
        extra = EXTRAS.get(scheme)
        how = f'pip install "vldist[{extra}]"' if extra else f"install the fsspec filesystem for {scheme}://"
        raise StoreSupportMissing(
            f"reading {redact(url)} needs {scheme}:// support, which is not installed: {how} ({err})"
        ) from None
