"""Errors of the object store told apart, and the retry loop: a transient error (HTTP 5xx, throttling, a timeout,
a reset connection) is retried with exponential backoff (0.2 s doubling to 5 s) within a budget of
``DENSETRAIN_STORE_RETRY_S`` seconds (default 120), each retry counted in :data:`counters`; a permanent one (not
found, a refusal) is raised at once; past the budget, :class:`StoreUnavailable`. Used by :mod:`densetrain.storage`
for every request it sends; the names are importable from there."""

from __future__ import annotations

import os
import re
import threading
import time

from densetrain.errors import ConfigError

counters = {"store_retries": 0, "store_cache_hits": 0, "store_cache_misses": 0, "store_bytes_fetched": 0}
"""Process-wide counts since start: retries of transient errors, cache hits and misses (blocks), bytes fetched."""
_lock = threading.Lock()


class StoreUnavailable(OSError):
    """The object store answered no request for longer than the retry budget (``DENSETRAIN_STORE_RETRY_S``):
    an outage, not a bad path. ``str()`` is one line naming the URL, the seconds tried and the last error."""


def _count(key: str, n: int = 1) -> None:
    with _lock:
        counters[key] += n


def retry_seconds() -> float:
    """The retry budget of one operation, seconds (``DENSETRAIN_STORE_RETRY_S``, default 120)."""
    return float(os.environ.get("DENSETRAIN_STORE_RETRY_S", "120"))


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


_TRANSPORT = ("ClientPayloadError", "ClientConnectionError", "HTTPClientError", "IncompleteReadError",
              "IncompleteRead", "ProtocolError")
"""The clients' exceptions for a transfer that broke before an answer was whole, matched by class name (in the
MRO; the clients are optional): aiohttp's cut-off body and lost connection, botocore's client-side HTTP errors
(a connection closed, a read timeout) and short body (``N read, but total bytes expected is M``), urllib3's and
http.client's short read. The HTTP status-like numbers they carry are not the store's answer."""

_PARSER_ERRORS = "HttpProcessingError"
"""aiohttp's HTTP parser errors (``ContentLengthError`` of a cut-off body, ``BadStatusLine``): their ``code`` 400 is
what a server would answer to such a message, not what the store answered."""


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _chain(e: BaseException | None, depth: int = 4):
    """``e`` and the errors it was raised from (``__cause__``), at most ``depth``."""
    for _ in range(depth):
        if e is None:
            return
        yield e
        e = e.__cause__


def _http_status(e: BaseException | None) -> int | None:
    """The HTTP status the client recorded for ``e`` or for the error it translated (``__cause__``, a few deep):
    gcsfs's ``HttpError.code``, aiohttp's ``.status``, botocore's ``ClientError.response`` (behind s3fs's
    OSError); not the ``code`` of aiohttp's parser errors (:data:`_PARSER_ERRORS`)."""
    for x in _chain(e):
        if _PARSER_ERRORS in _names(x):
            continue
        response = getattr(x, "response", None)
        meta = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
        for v in (getattr(x, "code", None), getattr(x, "status", None), meta):
            if isinstance(v, int) and 100 <= v < 600:
                return v
    return None


_LOCATION = re.compile(r"\S*://\S*|\S*/\S*")
"""URLs and paths inside an error's text: their digits (a port 34035, a shard 000404.ds) are not a status."""
_PERMANENT_TEXT = re.compile(r"NoSuchKey|NoSuchBucket|AccessDenied|InvalidAccessKeyId|\b403 Forbidden|\b404 Not Found|"
                             r"(?:HTTP|[Ss]tatus|code)\W{0,3}40[34]\b")
"""A refusal in words, or 403 / 404 named as a status: not any 403 / 404 (``403 read, but total bytes expected``)."""
_TRANSIENT_TEXT = re.compile(r"SlowDown|Timeout|timeout|Connection|ServiceUnavailable|InternalError|reset|Throttl|"
                             # gcsfs: HttpError("..., 429"); aiohttp: a dropped connection or a cut-off body
                             r"ServerDisconnected|ClientPayloadError|\b(?:408|429|50[0234])\b")


def _transient(e: BaseException) -> bool:
    """A 5xx, throttling, timeout or connection error (retried), not a missing object or a refusal. A transfer
    that broke (:data:`_TRANSPORT`) is transient; else the status the client recorded decides where there is one;
    else the error's text with its URLs and paths left out."""
    if isinstance(e, _PERMANENT):
        return False
    if any(_names(x) & set(_TRANSPORT) for x in _chain(e)):
        return True
    status = _http_status(e)
    if status is not None and status >= 400:
        return status in (408, 429) or status >= 500
    text = _LOCATION.sub("", f"{type(e).__name__}: {e}")
    if _PERMANENT_TEXT.search(text) or str(e).startswith("Forbidden: "):  # gcsfs's 403: an OSError, no code
        return False
    return isinstance(e, (OSError, TimeoutError, ConnectionError)) or bool(_TRANSIENT_TEXT.search(text))


_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
"""botocore's exceptions for a credential chain that found nothing usable (matched by name: botocore is s3fs's)."""


def retrying(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, retried with backoff while it fails with a transient error (module docstring).

    Raises: StoreUnavailable: still failing after the retry budget; other errors as ``fn`` raises them."""
    budget, t0, wait = retry_seconds(), time.monotonic(), 0.2
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below; permanent ones are re-raised
            if type(e).__name__ in _NO_CREDENTIALS:  # botocore's: a traceback of 79 lines before
                raise ConfigError(f"{what}: no credentials for the object store ({type(e).__name__}): give them "
                                  f"through the client's standard chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                                  f"~/.aws/credentials or an instance role for s3://)") from None
            if not _transient(e):
                raise
            spent = time.monotonic() - t0
            if spent + wait > budget:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise StoreUnavailable(f"{what}: the object store did not answer for {spent:.0f} s "
                                       f"(DENSETRAIN_STORE_RETRY_S={budget:g}; last error {type(e).__name__}: "
                                       f"{first})") from None
            _count("store_retries")
            time.sleep(wait)
            wait = min(wait * 2, 5.0)


