"""Credentials stay out of a job's configuration: config.yaml, metrics.json and every checkpoint
record the whole configuration, so a key or token there would be written to disk and shown in
logs. Stores take them from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN for S3; GOOGLE_APPLICATION_CREDENTIALS for GCS), as their own clients do."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from vldist.store.location import is_url

_NAMES = {"key", "secret", "token", "password", "passwd", "authorization", "auth", "credentials"}
_PARTS = ("secret", "password", "access_key", "session_token", "api_key", "private_key")
HOW = (
    "set credentials in the environment instead (S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_SESSION_TOKEN; GCS: GOOGLE_APPLICATION_CREDENTIALS), where the store's client reads them"
)


def credential_keys(options: Any, prefix: str = "") -> list[str]:
    """The dotted names of the keys in (nested) options that would hold a credential."""
    found = []
    if isinstance(options, dict):
        for name, value in options.items():
            dotted = f"{prefix}{name}"
            lowered = str(name).lower()
            if lowered in _NAMES or any(part in lowered for part in _PARTS):
                found.append(dotted)
            else:
                found += credential_keys(value, dotted + ".")
    return found


def url_credentials(where: str) -> str | None:
    """What in a URL would carry a credential (user:password@, a query such as a signature); None if nothing."""
    if not is_url(where):
        return None
    parts = urlsplit(where)
    if parts.username or parts.password:
        return "user:password@"
    if parts.query:
        return "a query (?...)"
    return None


def refuse_credentials(field: str, value: Any) -> None:
    """Raise ValueError (a config error) when a URL (data.shards, output.checkpoint_dir) or store
    options (data.storage_options, output.storage_options) carry a credential."""
    url = value is None or isinstance(value, str)
    found = url_credentials(value) if url else ", ".join(credential_keys(value))
    if found:
        what = f"the URL carries {found}" if url else f"{found} would hold a credential"
        raise ValueError(f"{what}, and config.yaml, metrics.json and checkpoints record the configuration: {HOW}")
