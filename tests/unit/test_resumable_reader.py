"""A remote read resumes at the byte it reached after a transient error (here on fsspec's in-memory
filesystem, whose files seek: a ranged read; the HTTP path, which skips instead, is tested against a
real server in tests/integration/test_remote_shards.py), gives up after data.retries, and tells
transient errors from lasting ones."""

from __future__ import annotations

import random

import fsspec
import pytest

from vldist.store import reader as reader_module
from vldist.store.access import StoreAccess
from vldist.store.reader import ResumableReader, ShardUnavailable
from vldist.store.retry import ReadInterrupted, RetryPolicy, transient


class FlakyFile:
    """A file of the in-memory filesystem that raises ConnectionResetError after `cut` bytes."""

    def __init__(self, inner, cut: int | None, seeks: list[int]):
        self.inner, self.cut, self.seeks, self.read_bytes = inner, cut, seeks, 0

    def seek(self, position):
        self.seeks.append(position)
        self.inner.seek(position)

    def read(self, n):
        if self.cut is not None and self.read_bytes >= self.cut:
            raise ConnectionResetError("connection reset by peer")
        data = self.inner.read(n if self.cut is None else min(n, self.cut - self.read_bytes))
        self.read_bytes += len(data)
        return data

    def close(self):
        self.inner.close()


@pytest.fixture
def flaky(monkeypatch):
    """(url, data, cuts, seeks): an object in memory whose next opens are cut after `cuts` bytes each."""
    memory = fsspec.filesystem("memory")
    data = random.Random(0).randbytes(300_000)
    memory.pipe_file("/flaky/shard.tar", data)
    cuts, seeks = [], []
    real = reader_module.filesystem

    def filesystem(url, options=None):
        fs, path = real(url, options)

        class Flaky:
            size = staticmethod(fs.size)

            @staticmethod
            def open(p, mode, **kw):
                return FlakyFile(fs.open(p, mode), cuts.pop(0) if cuts else None, seeks)

        return Flaky, path

    monkeypatch.setattr(reader_module, "filesystem", filesystem)
    yield "memory:///flaky/shard.tar", data, cuts, seeks
    memory.rm("/flaky", recursive=True)


def read_all(reader: ResumableReader, chunk: int = 8192) -> bytes:
    out = []
    while part := reader.read(chunk):
        out.append(part)
    return b"".join(out)


def test_each_cut_resumes_at_the_byte_reached_with_a_seek(flaky):
    url, data, cuts, seeks = flaky
    cuts += [10_000, 5, 100_000]  # three opens cut; the fourth reads to the end
    state = random.getstate()
    reader = ResumableReader(url, sleep=lambda s: None)
    assert read_all(reader) == data
    assert reader.reopened == 3 and seeks == [10_000, 10_005, 110_005]
    assert random.getstate() == state  # the jitter has a generator of its own


def test_a_read_that_keeps_failing_gives_up_after_the_retries_naming_the_url(flaky):
    url, data, cuts, seeks = flaky
    cuts += [50] + [0] * 10
    reader = ResumableReader(url, StoreAccess(retry=RetryPolicy(retries=3)), sleep=lambda s: None)
    with pytest.raises(
        ShardUnavailable,
        match=r"memory:///flaky/shard.tar: 4 tries failed at byte 50 of 300000; "
        r"last: ConnectionResetError",
    ):
        read_all(reader)


def test_progress_resets_the_budget(flaky):
    url, data, cuts, seeks = flaky
    cuts += [20_000] * 14  # 14 cuts in all, each after 20,000 bytes of progress
    reader = ResumableReader(url, StoreAccess(retry=RetryPolicy(retries=1)), sleep=lambda s: None)
    assert read_all(reader, 4096) == data and reader.reopened == 14


def test_waits_grow_exponentially_up_to_the_cap():
    policy, rng = RetryPolicy(retries=8, first_wait=0.5, max_wait=4.0), random.Random(1)
    for attempt, cap in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (8, 4.0)]:
        waits = [policy.wait(attempt, rng) for _ in range(200)]
        assert 0 <= min(waits) and max(waits) <= cap and max(waits) > cap / 2


class StatusError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


class ClientError(Exception):  # botocore's shape: a response dict with the error code
    def __init__(self, code):
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class ClientPayloadError(Exception):  # aiohttp's name: a body cut short
    pass


@pytest.mark.parametrize(
    "error, expected",
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (ReadInterrupted("early end"), True),
        (ClientPayloadError(), True),
        (StatusError(503), True),
        (StatusError(429), True),
        (ClientError("SlowDown"), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (StatusError(404), False),
        (StatusError(403), False),
        (ClientError("AccessDenied"), False),
        (ClientError("NoSuchBucket"), False),
        (ValueError("a bug"), False),
    ],
)
def test_transient_errors_are_told_from_lasting_ones(error, expected):
    assert transient(error) is expected


def test_a_lost_store_ends_the_stream_and_reaches_the_user_without_the_workers_traceback():
    from vldist.data.skips import SkipCounter
    from vldist.errors import StoreLost

    with pytest.raises(StoreLost):
        SkipCounter()(StoreLost("the store of s3://b/set stopped answering"))  # not counted and skipped
    # what torch's DataLoader makes of a worker's exception: exc_type("Caught ... Original Traceback ...")
    relayed = StoreLost(
        "Caught StoreLost in DataLoader worker process 0.\nOriginal Traceback (most recent call "
        'last):\n  File "x.py", line 1, in f\nvldist.errors.StoreLost: the store of s3://b/set '
        "stopped answering\n"
    )
    assert str(relayed) == "the store of s3://b/set stopped answering"
    webdataset_args = StoreLost("the store stopped answering")
    webdataset_args.args = webdataset_args.args + ("<stream>", "s3://b/set/x.tar")
    assert str(webdataset_args) == "the store stopped answering"
