"""Samples of a list of shards, local or remote: WebDataset's tar expander and key grouping over
streams this module opens (a local file as WebDataset would, a URL through fsspec, vldist/store),
because WebDataset's own openers reach s3:// and gs:// only through command-line tools."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from webdataset.tariterators import group_by_keys, tar_file_expander

from vldist.store.location import open_binary, redact


def _opened(urls: Iterable[str], storage_options: dict[str, Any] | None,
            handler: Callable[[Exception], bool]) -> Iterator[dict]:
    for url in urls:
        try:
            stream = open_binary(url, storage_options)
        except Exception as exn:  # noqa: BLE001 - the handler decides (count and skip, or stop)
            exn.args = exn.args + (redact(url),)
            if handler(exn):
                continue
            break
        yield {"url": url, "stream": stream}


def shard_samples(urls: Iterable[str], handler: Callable[[Exception], bool],
                  select_files: Callable[[str], bool] | None = None,
                  storage_options: dict[str, Any] | None = None) -> Iterator[dict]:
    """Raw samples ({"__key__", "__url__", member name: bytes}) of the shards, in order."""
    files = tar_file_expander(_opened(urls, storage_options, handler), handler=handler, select_files=select_files)
    return group_by_keys(files, handler=handler)
