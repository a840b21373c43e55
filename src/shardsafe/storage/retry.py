"""Which storage errors are worth another try, and the retry loop with exponential backoff.

Connection errors, timeouts, 5xx and throttling are transient; a missing object or a
refused permission is final and fails at once.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("shardsafe.storage.fsspec")

T = TypeVar("T")

# S3 error codes worth another try whatever their HTTP status (S3 sends RequestTimeout as 400).
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)
_TRANSIENT_STATUS = frozenset({408, 429})
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN",
        "EBUSY",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "EREMOTEIO",
        "ENETUNREACH",
        "ENETDOWN",
        "EHOSTUNREACH",
    )
    if hasattr(errno, name)
)
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception types of the HTTP stacks fsspec backends use, if installed."""
    import asyncio

    found: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    with suppress(ImportError):
        from botocore import exceptions as bx

        found += [bx.HTTPClientError, bx.ConnectionError]
    with suppress(ImportError):
        import aiohttp

        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(found)


_TRANSPORT = _transport_errors()


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its explicit causes: backends wrap the HTTP error (s3fs raises OSError from ClientError).

    Implicit ``__context__`` is not followed: an error raised while handling another one
    says nothing about whether the first was transient.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__


def http_error(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and service error code found anywhere in ``exc``'s chain, if any."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            return (status if isinstance(status, int) else None), (str(code) if code else None)
        for attr in ("status_code", "status", "code"):
            value = getattr(e, attr, None)
            if isinstance(value, int) and 100 <= value <= 599:
                return value, None
    return None, None


def is_transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed: connection trouble, timeouts, 5xx, throttling.

    Not-found, permission, precondition and other 4xx answers are final.
    """
    status, code = http_error(exc)
    if code in _TRANSIENT_CODES:
        return True
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT):
        return False
    for e in _chain(exc):
        if isinstance(e, _TRANSPORT):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` extra attempts after the first, sleeping ``backoff * 2**n`` (jittered, capped)."""

    retries: int = 5
    backoff: float = 0.2
    max_backoff: float = 10.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based); jitter spreads out ranks."""
        base = min(self.max_backoff, self.backoff * (2**attempt))
        return base * random.uniform(0.5, 1.0)


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``fn``; on a transient error wait and try again, up to ``policy.retries`` times."""
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if attempt >= policy.retries or not is_transient(e):
                raise
            wait = policy.delay(attempt)
            attempt += 1
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs",
                what,
                type(e).__name__,
                e,
                attempt,
                policy.retries,
                wait,
            )
            sleep(wait)
