"""Which errors of a remote read are worth another try, and how long to wait before each.

The stores' own clients retry a little (s3fs about 5 times over a few seconds, fsspec's HTTP not
at all); a shard read for minutes needs a budget of its own, measured in tries without progress."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from vldist.errors import StoreLost

# error classes of the stores' client libraries, by name (no import of packages a job may lack)
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ServerTimeoutError",
    "ContentLengthError",
    "TransferEncodingError",
    "IncompleteRead",
    "IncompleteReadError",
    "ConnectionClosedError",
    "EndpointConnectionError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "FSTimeoutError",
    "ProtocolError",
}
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "ThrottlingException"}


class ShardUnavailable(OSError):
    """A shard could not be read within the retry budget, or its download did not check out; the
    message says where and what was tried."""


class ShardLostInExactEpoch(StoreLost):
    """A shard failed for good in an exact epoch (data.resampled=false), where every rank reads
    every shard in one global order: skipping it on one rank would put the ranks' batches out of
    step, so the run ends instead (the message says what to do)."""


class ReadInterrupted(ConnectionError):
    """A read ended before the object's size: a connection closed early without an error."""


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `retries` tries again after failures in a row without a byte of progress, waiting with
    exponential backoff (full jitter) from `first_wait` up to `max_wait` seconds before each: with
    the defaults at most about 2.5 minutes in all, which a rank's peers wait out in their next
    collective."""

    retries: int = 8
    first_wait: float = 0.5
    max_wait: float = 30.0

    def wait(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `attempt` (from 1)."""
        return rng.uniform(0, min(self.max_wait, self.first_wait * 2 ** (attempt - 1)))


def transient(error: BaseException) -> bool:
    """Whether another try may succeed: a dropped, reset or truncated connection, a timeout, a
    store that is busy (HTTP 429, 5xx, S3's SlowDown). A missing object, a refused credential or any
    other 4xx is not."""
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        return transient(error.__cause__)  # fsspec's HTTP reports any failed HEAD as missing: its cause says why
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "status_code", None)
    if isinstance(status, int):
        return status == 429 or status >= 500
    response = getattr(error, "response", None)  # botocore's ClientError: {"Error": {"Code": ...}}
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code is not None:
        return code in _TRANSIENT_CODES
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & _TRANSIENT_NAMES) or isinstance(error, (ConnectionError, TimeoutError, asyncio.TimeoutError))
