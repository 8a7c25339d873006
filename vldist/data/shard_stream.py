"""Samples of a list of shards, local or remote: WebDataset's tar expander and key grouping over
streams this module opens (a local file as WebDataset would, a URL through fsspec, vldist/store),
because WebDataset's own openers reach s3:// and gs:// only through command-line tools.

Each shard is read alone and its samples counted against what its manifest lists: Python's tar
reader takes a tar cut at a member's boundary for a shorter whole one, so a shard cut short is
found only by its count. The samples it lacks are reported once per reading, as MissingSamples
(data/skips.py), with where it broke when the reader said.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from webdataset.tariterators import group_by_keys, tar_file_expander

from vldist.data.skips import MissingSamples
from vldist.errors import StoreLost
from vldist.store.access import StoreAccess
from vldist.store.location import redact
from vldist.store.reader import open_shard
from vldist.store.retry import ShardUnavailable

Handler = Callable[[BaseException], bool]  # True: go on; the shard is on the exception (`exn.shard`)


def listed_counts(manifest: dict, split: str, urls: Iterable[str]) -> dict[str, int]:
    """The samples the manifest lists for each of the split's shard URLs (by file name); none for a
    set without per-shard counts (shards from other tools)."""
    listed = {s.get("file"): s.get("samples") for s in manifest.get("splits", {}).get(split, {}).get("shards", [])}
    counts = {url: listed.get(url.rsplit("/", 1)[-1]) for url in urls}
    return {url: n for url, n in counts.items() if isinstance(n, int)}


def shard_samples(
    urls: Iterable[str],
    handler: Handler,
    select_files: Callable[[str], bool] | None = None,
    access: StoreAccess | None = None,
    listed: dict[str, int] | None = None,
) -> Iterator[dict]:
    """Raw samples ({"__key__", "__url__", member name: bytes}) of the shards, in order. `listed`:
    the samples each shard's manifest lists; a shard that yields fewer is reported to the handler
    as MissingSamples, its tar errors folded into that one report."""
    listed = listed or {}
    for url in urls:
        yield from _one_shard(url, handler, select_files, access, listed.get(url))


def _one_shard(url: str, handler: Handler, select_files, access, expected: int | None) -> Iterator[dict]:
    try:
        stream = open_shard(url, access)
    except Exception as exn:  # noqa: BLE001 - the handler decides (count and skip, or stop)
        exn.args = exn.args + (redact(url),)
        exn.shard = url
        handler(exn)
        return
    broke: list[BaseException] = []

    def tar_error(exn: BaseException) -> bool:
        """A tar error inside the shard: a lost store ends the run, a shard the store could not serve
        is the handler's to judge; the rest is counted with the samples it cost, at the shard's end."""
        if isinstance(exn, (StoreLost, ShardUnavailable)) or expected is None:
            exn.shard = url
            return handler(exn)
        broke.append(exn)
        return True

    files = tar_file_expander([{"url": url, "stream": stream}], handler=tar_error, select_files=select_files)
    read = 0
    for sample in group_by_keys(files, handler=tar_error):
        read += 1
        yield sample
    if expected is not None and read < expected:
        reason = f"{type(broke[0]).__name__}: {broke[0]}" if broke else "the tar ends early, at a member's boundary"
        handler(
            MissingSamples(
                f"{redact(url)} holds {read} of the {expected} samples its manifest lists ({reason}); "
                "`python -m vldist.shards verify` lists every damaged shard",
                expected - read,
                url,
            )
        )
    elif broke:  # a damaged member, all samples there (a listed count too low): count the error itself
        for exn in broke:
            exn.shard = url
            handler(exn)
