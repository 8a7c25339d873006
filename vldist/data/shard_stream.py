"""Samples of a list of shards, local or remote: WebDataset's tar expander and key grouping over
streams this module opens (a local file as WebDataset would, a URL through fsspec, vldist/store),
because WebDataset's own openers reach s3:// and gs:// only through command-line tools."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from webdataset.tariterators import group_by_keys, tar_file_expander

from vldist.store.access import StoreAccess
from vldist.store.location import redact
from vldist.store.reader import open_shard


def _opened(urls: Iterable[str], access: StoreAccess | None, handler: Callable[[Exception], bool]) -> Iterator[dict]:
    for url in urls:
        try:
            stream = open_shard(url, access)
        except Exception as exn:  # noqa: BLE001 - the handler decides (count and skip, or stop)
            exn.args = exn.args + (redact(url),)
            if handler(exn):
                continue
            break
        yield {"url": url, "stream": stream}


def shard_samples(
    urls: Iterable[str],
    handler: Callable[[Exception], bool],
    select_files: Callable[[str], bool] | None = None,
    access: StoreAccess | None = None,
) -> Iterator[dict]:
    """Raw samples ({"__key__", "__url__", member name: bytes}) of the shards, in order."""
    files = tar_file_expander(_opened(urls, access, handler), handler=handler, select_files=select_files)
    return group_by_keys(files, handler=handler)
