"""Object stores and local disk as the readers see them: a path or URI opened as a `Store`,
comma-separated files, folders and globs resolved to files, and every call to the store retried
while it fails transiently.

An s3:// URI gets pyarrow's AWS standard retry strategy (`retry_attempts` tries per request).
On top of it, a listing, footer or row-group read that fails with a transient error (network,
timeout, throttling, 5xx: `_transient`) is retried with exponential backoff for up to
`retry_seconds` from its first failure, re-opening the file, each retry logged on
"rankmix.data"; past that budget the caller gets DataUnavailableError. A missing or corrupt
file is a ValueError at once. No message shows a URI's credentials (`redact_uri`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from trainer.credentials import redact_uri
from trainer.errors import DataUnavailableError

log = logging.getLogger("rankmix.data")
T = TypeVar("T")

FIRST_RETRY_DELAY = 0.25  # seconds; doubled after each failure ...
MAX_RETRY_DELAY = 10.0    # ... up to this: a store that comes back is found within 10 s
S3_URI_OPTIONS = ("endpoint_override", "scheme", "region")
# pyarrow raises OSError for network failures and for corrupt files alike ("Couldn't
# deserialize thrift"), so the transient ones are told apart by their AWS error codes
# (those the AWS SDK itself retries), HTTP 5xx, curl failures and socket errors.
_TRANSIENT = re.compile(r"NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|REQUEST_TIMEOUT|"
                        r"THROTTLING|HTTP status 5\d\d|curlCode|timed out|connection reset|broken pipe", re.I)


@dataclass(frozen=True)
class Store:
    """A filesystem, its name in messages ("s3 endpoint host:port") and its retry budget.
    `key` is equal for URIs that address the same store with the same options."""

    fs: pafs.FileSystem
    name: str
    key: tuple = field(repr=False)  # holds an S3 URI's credentials
    retry_seconds: float = 300.0

    def call(self, fn: Callable[[], T], what: str) -> T:
        return _retrying(fn, self.name, what, self.retry_seconds)


def _retrying(fn: Callable[[], T], store: str, what: str, budget: float) -> T:
    """fn(), called again while it fails transiently, with exponential backoff, for up to
    `budget` seconds from its first failure; then DataUnavailableError. `fn` must start
    afresh each call (re-open what it reads): a failed stream may be dead."""
    start, delay = time.monotonic(), FIRST_RETRY_DELAY
    while True:
        try:
            return fn()
        except OSError as e:
            if not _transient(e):
                raise
            spent = time.monotonic() - start
            if spent >= budget:
                raise DataUnavailableError(f"{store}, {what}: unreachable for {spent:.1f} s "
                                           f"(retry budget {budget:g} s): {reason(e)}") from e
            wait = min(delay, budget - spent)
            log.warning("%s, %s: %s; retrying in %.2f s (%.1f s of the %g s retry budget left)",
                        store, what, reason(e), wait, budget - spent, budget)
            time.sleep(wait)
            delay = min(2 * delay, MAX_RETRY_DELAY)


def _transient(e: OSError) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return not isinstance(e, (FileNotFoundError, PermissionError)) and bool(_TRANSIENT.search(str(e)))


def reason(e: BaseException) -> str:
    """The gist of a store error on one line: pyarrow's S3 errors from "AWS Error", without
    the curl details."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text[text.find("AWS Error"):] if "AWS Error" in text else text
    return redact_uri(text.split("; Details:")[0])[:200]


def resolve_files(spec: str, *, retry_seconds: float = 300.0,
                  retry_attempts: int = 3) -> tuple[pafs.FileSystem, list[str]]:
    """Comma-separated files, directories (every *.parquet below) or globs; local or URI."""
    store, files = resolve(spec, retry_seconds, retry_attempts)
    return store.fs, [f.path for f in files]


def resolve(spec: str, retry_seconds: float, retry_attempts: int) -> tuple[Store, list[pafs.FileInfo]]:
    if not retry_seconds >= 0:
        raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
    if retry_attempts < 1:
        raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
    store: Store | None = None
    files: list[pafs.FileInfo] = []
    opened: dict[tuple, Store] = {}  # a table's thousands of files share one S3 client (and region lookup)
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        item_store, path = open_store(item, retry_seconds, retry_attempts, opened)
        if store is not None and item_store.key != store.key:
            raise ValueError(f"data path {redact_uri(spec)!r} mixes filesystems "
                             f"({store.name}, {item_store.name})")
        store = store or item_store
        files += _expand(store, path, redact_uri(item))
    if store is None or not files:
        raise ValueError(f"no Parquet files found at {redact_uri(spec)!r}")
    return store, files


def open_store(item: str, retry_seconds: float, retry_attempts: int,
               opened: dict[tuple, Store] | None = None) -> tuple[Store, str]:
    """The store of one path or URI, and the path in it; an S3 store already in `opened` (by
    credentials, bucket and options) is used again."""
    if item.startswith("s3://"):
        return _s3_store(item, retry_seconds, retry_attempts, {} if opened is None else opened)
    if "://" in item:
        try:
            fs, path = pafs.FileSystem.from_uri(item)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"cannot open {redact_uri(item)}: {redact_uri(str(e))}") from None
        return Store(fs, f"{fs.type_name} store", (fs.type_name,), retry_seconds), path
    return Store(pafs.LocalFileSystem(), "local disk", ("local",), retry_seconds), posixpath.abspath(item)


def _s3_store(uri: str, retry_seconds: float, retry_attempts: int, opened: dict[tuple, Store]) -> tuple[Store, str]:
    """s3://[KEY:SECRET@]bucket/key[?endpoint_override=&scheme=&region=], built here because
    FileSystem.from_uri takes no retry strategy. Without user-info the credentials come
    from the AWS default chain (AWS_* variables, ~/.aws, instance metadata); without region
    and endpoint the bucket's region is looked up, as from_uri does."""
    parts = urlsplit(uri)
    options = dict(parse_qsl(parts.query))
    unknown = sorted(set(options) - set(S3_URI_OPTIONS))
    if unknown:
        raise ValueError(f"{redact_uri(uri)}: unknown S3 URI option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(S3_URI_OPTIONS)})")
    user, _, bucket = parts.netloc.rpartition("@")
    if not bucket or ":" in bucket:  # a ':' is a secret cut short by an unescaped '/'
        raise ValueError(f"{redact_uri(uri)}: expected s3://bucket/key or s3://KEY:SECRET@bucket/key "
                         "(percent-encode '/', '@', '#' and '?' in the key and secret as %2F, %40, %23 and %3F)")
    path = (bucket + parts.path).rstrip("/")
    reuse = (user, bucket, tuple(sorted(options.items())))
    if reuse in opened:
        return opened[reuse], path
    key, _, secret = user.partition(":")
    credentials = dict(access_key=unquote(key), secret_key=unquote(secret)) if user else {}
    _endpoint_from_environment(options)
    endpoint = options.get("endpoint_override")
    try:
        if not endpoint and "region" not in options:
            options["region"] = _retrying(partial(pafs.resolve_s3_region, bucket), "s3 endpoint AWS", bucket,
                                          retry_seconds)
        fs = pafs.S3FileSystem(**credentials, **options,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=retry_attempts))
    except (pa.ArrowException, OSError) as e:  # no such bucket, a bad scheme, ...
        raise ValueError(f"{redact_uri(uri)}: {reason(e)}") from None
    name = f"s3 endpoint {endpoint or 'AWS ' + options['region']}"
    key_of = ("s3", user, tuple(sorted(options.items())))
    opened[reuse] = Store(fs, name, key_of, retry_seconds)
    return opened[reuse], path


def _endpoint_from_environment(options: dict[str, str]) -> None:
    """AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (and AWS_REGION / AWS_DEFAULT_REGION) as the URI's
    endpoint_override, scheme and region where it gives none: the AWS SDKs' and deltalake's
    variables, which pyarrow's S3 client does not read, so that one environment serves both."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url or "endpoint_override" in options:
        return
    parts = urlsplit(url if "://" in url else f"https://{url}")
    options["endpoint_override"] = parts.netloc
    options.setdefault("scheme", parts.scheme)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options.setdefault("region", region)


def _expand(store: Store, path: str, shown: str) -> list[pafs.FileInfo]:
    """The files `path` names, sorted by path."""
    fs = store.fs
    if any(c in path for c in "*?["):
        parent, pattern = posixpath.split(path)
        infos = store.call(lambda: fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True)), parent)
        return sorted((i for i in infos if i.is_file and fnmatch.fnmatch(i.base_name, pattern)), key=lambda i: i.path)
    info = store.call(lambda: fs.get_file_info(path), path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"data path not found: {shown}")
    if info.type == pafs.FileType.Directory:
        infos = store.call(lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True)), path)
        return sorted((i for i in infos if i.is_file and i.base_name.endswith(".parquet")), key=lambda i: i.path)
    return [info]
