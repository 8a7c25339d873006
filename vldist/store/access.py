"""How a job reaches its shard sets' store: the filesystem's options and the retry budget of a
shard read. Picklable and free of open connections, so loader workers carry it across a fork and
open their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vldist.store.cache import CacheConfig
from vldist.store.retry import RetryPolicy


@dataclass(frozen=True)
class StoreAccess:
    storage_options: dict[str, Any] = field(default_factory=dict)  # data.storage_options
    retry: RetryPolicy = RetryPolicy()
    cache: CacheConfig | None = None  # data.cache_dir: remote shards read through a per-node cache
    checksums: dict[str, str] = field(default_factory=dict)  # shard URL -> sha256, from the set's manifest

    @classmethod
    def of(cls, data) -> StoreAccess:
        """From a job's data section (data.storage_options, data.retries, data.cache_dir, data.cache_max_gb)."""
        cache = CacheConfig(data.cache_dir, int(data.cache_max_gb * 2**30)) if data.cache_dir else None
        return cls(dict(data.storage_options), RetryPolicy(retries=data.retries), cache)
