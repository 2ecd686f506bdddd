"""Remote objects (``s3://``, ``gs://``, ``https://``, any fsspec URL): filesystems, listing, errors.

Shards are read through a local cache of whole objects (``shard_cache.py``). Nothing may hang a
run: every request has connect and read timeouts, and transient failures are retried a bounded
number of times with backoff.

Errors: ``DataError`` (the run stops with its message) for a missing bucket or object where one
is required (``stat_remote``, ``expand_remote``, ``ShardCache.local``), denied access anywhere, a
network failure while opening sources (``stat_remote``, ``expand_remote``), a download lock held
past its deadline. ``RemoteReadError`` (an ``OSError``) for a network failure that outlasted the
retries in ``ShardCache.local``/``open``/``read_bytes`` (``Unreachable``), and a missing object in
``read_bytes``: a per-sample reader replaces the sample, as for a missing local image, and the
bad-sample limit stops a run whose storage went away. fsspec and its backends are imported on first
use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from typing import Any, Callable

from vltrain.data.sources.patterns import expand_braces
from vltrain.errors import DataError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
"""Longest wait for a connection, and for the next bytes of a response (not for a whole object)."""
RETRIES = 2
"""Retries of one request after a transient failure. Under them botocore makes 2 attempts (s3fs's
own retry loop is turned off), so a server that accepts connections and then stays silent fails a
request after (1 + RETRIES) x 2 x READ_TIMEOUT_S, about 3 minutes; a refused connection in seconds."""
BACKOFF_S = 0.5
"""First retry delay; it doubles with each retry."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "fsspec", "http")


class RemoteReadError(OSError):
    """A remote object could not be read now; per-sample readers replace the sample."""


class Unreachable(RemoteReadError):
    """A network failure that outlasted the retries: the storage itself may be down."""


def is_remote(path: str) -> bool:
    """A URL with a scheme other than ``file://`` (``s3://``, ``gs://``, ``https://``, ...)."""
    m = _SCHEME.match(str(path))
    return m is not None and m.group(1).lower() != "file"


def _protocol(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else "file"


def default_options(protocol: str) -> dict[str, Any]:
    """Timeouts and retries for ``protocol``, and for S3 the endpoint from the AWS variables."""
    if protocol in ("s3", "s3a"):
        options: dict[str, Any] = {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                                                     "retries": {"total_max_attempts": 2, "mode": "standard"}}}
        # botocore reads these itself only from 1.31.68 on; passing them works with any version
        ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and not ignore:
            options["endpoint_url"] = endpoint
        return options
    if protocol in ("gs", "gcs"):
        return {"requests_timeout": READ_TIMEOUT_S}  # gcsfs retries 6 times itself
    if protocol in ("http", "https"):
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        return {"client_kwargs": {"timeout": timeout}}
    return {}


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it.

    ``storage_options`` (``data.storage_options``) override the defaults key by key; mappings
    (``config_kwargs``, ``client_kwargs``) are merged one level deep, so ``{config_kwargs:
    {read_timeout: 300}}`` keeps the default retries.
    """
    try:
        import fsspec

        options = default_options(_protocol(url))
        for key, value in (storage_options or {}).items():
            if isinstance(value, dict) and isinstance(options.get(key), dict):
                options[key] = {**options[key], **value}
            else:
                options[key] = value
        fs, path = fsspec.core.url_to_fs(url, **options)
        if _protocol(url) in ("s3", "s3a"):
            fs.retries = 1  # one attempt per call of s3fs: the retries are botocore's and ours
        return fs, path
    except ImportError as e:
        extra = _EXTRAS.get(_protocol(url))
        how = f"pip install 'vltrain[{extra}]'" if extra else f"install the fsspec backend ({e})"
        raise DataError(f"{url}: reading {_protocol(url)}:// URLs needs an extra package: {how}") from e
    except ValueError as e:
        raise DataError(f"{url}: not a URL vltrain can read ({e})") from e


def _kind(e: BaseException) -> str | None:
    """missing, denied, network (worth retrying), or None: not a storage error, let it through."""
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, PermissionError):
        return "denied"
    if isinstance(e, (OSError, TimeoutError)) or type(e).__module__.split(".")[0] in _NETWORK_MODULES:
        return "network"
    return None


def store_of(url: str, options: dict | None) -> str:
    """Where ``url``'s bytes come from: the endpoint and bucket (S3), the bucket (GCS), the host."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]+)://([^/]*)", url)
    protocol, host = (m.group(1).lower(), m.group(2)) if m else ("file", "")
    if protocol in ("s3", "s3a"):
        endpoint = {**default_options("s3"), **(options or {})}.get("endpoint_url") or "AWS's endpoint"
        return f"bucket {host} at {endpoint}"
    return f"{protocol}://{host}"


def _hint(url: str, options: dict | None) -> str:
    if _protocol(url) in ("s3", "s3a"):
        endpoint = {**default_options("s3"), **(options or {})}.get("endpoint_url")
        where = f"endpoint {endpoint}" if endpoint else "AWS's endpoint (set AWS_ENDPOINT_URL for another server)"
        return (f"check the bucket and key, the {where}, and the credentials (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or data.storage_options)")
    if _protocol(url) in ("gs", "gcs"):
        return ("check the bucket and object name and the credentials (GOOGLE_APPLICATION_CREDENTIALS, "
                "or data.storage_options.token)")
    return "check the URL, that the server is reachable, and data.storage_options"


def retrying(fn: Callable[[], Any], url: str, options: dict | None, retries: int, backoff_s: float) -> Any:
    """``fn()``, retried on transient errors; missing objects raise FileNotFoundError at once."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            kind = _kind(e)
            if kind is None or kind == "missing":
                raise
            if kind == "denied":
                raise DataError(f"{url}: access denied ({describe_error(e)}); {_hint(url, options)}") from e
            if attempt == retries:
                raise Unreachable(
                    f"{url}: not readable after {retries + 1} attempts ({describe_error(e)}); {_hint(url, options)}"
                ) from e
            wait = backoff_s * 2**attempt
            log.warning("%s: attempt %d of %d failed (%s); retrying in %g s", url, attempt + 1, retries + 1,
                        describe_error(e), wait)
            time.sleep(wait)


def describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def missing_error(url: str, e: BaseException, options: dict | None) -> DataError:
    return DataError(f"{url}: no such object or bucket ({describe_error(e)}); {_hint(url, options)}")


def expand_remote(pattern: str, storage_options: dict | None = None, *, retries: int = RETRIES,
                  backoff_s: float = BACKOFF_S) -> list[str]:
    """Brace ranges and lists expanded, then globs (``* ? [``) listed and sorted; full URLs.

    A URL without glob characters is returned as it is (``stat_remote`` finds out whether it
    exists); a glob that matches nothing is a DataError. HTTP(S) servers cannot be listed, so
    only braces apply there.
    """
    out: list[str] = []
    for url in expand_braces(pattern):
        fs, path = filesystem(url, storage_options)
        if not any(c in path for c in "*?["):
            out.append(url)
            continue
        if _protocol(url) in ("http", "https"):
            raise DataError(f"{url}: http(s) URLs cannot be listed; name shards with brace ranges "
                            "like shards/{00000..00099}.tar")
        try:
            found = retrying(lambda: fs.glob(path), url, storage_options, retries, backoff_s)
        except (FileNotFoundError, RemoteReadError) as e:
            raise DataError(f"{url}: cannot list ({e})") from e
        found = sorted(p for p in found if not p.endswith("/"))
        if not found:
            raise DataError(f"{url}: no objects match; {_hint(url, storage_options)}")
        out.extend(fs.unstrip_protocol(p) for p in found)
    return out


_VERSION_KEYS = ("ETag", "etag", "generation", "LastModified", "mtime", "updated", "Last-Modified")


def stat_remote(url: str, storage_options: dict | None = None, *, retries: int = RETRIES,
                backoff_s: float = BACKOFF_S) -> dict:
    """``{"size": int | None, "version": str}`` of one object, asked of the server (not a cache).

    ``version`` is the ETag (S3, HTTP), the generation (GCS) or the modification time, "" when
    the server gives none; with the size it tells whether an object changed since it was indexed
    or downloaded. ``size`` is None only from an HTTP server that does not send it.
    """
    fs, path = filesystem(url, storage_options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    try:
        info = retrying(lambda: fs.info(path), url, storage_options, retries, backoff_s)
    except FileNotFoundError as e:
        raise missing_error(url, e, storage_options) from e
    except RemoteReadError as e:
        raise DataError(str(e)) from e
    if info.get("type") == "directory":
        raise DataError(f"{url}: is a folder, not an object; name the objects in it, e.g. {url.rstrip('/')}/*.tar")
    version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) not in (None, "")), "")
    size = info.get("size")
    return {"size": None if size is None else int(size), "version": version}


def stat_many(urls: list[str], storage_options: dict | None = None) -> list[dict]:
    """``stat_remote`` of many objects, from one listing per folder where the store lists (S3,
    GCS), not a request per shard; a missing object is a DataError naming how many and which."""
    if _protocol(urls[0]) in ("http", "https"):
        return [stat_remote(u, storage_options) for u in urls]
    fs, _ = filesystem(urls[0], storage_options)
    listed: dict[str, dict] = {}
    for folder in dict.fromkeys(u.rsplit("/", 1)[0] for u in urls):
        try:
            entries = retrying(lambda: fs.ls(fs._strip_protocol(folder), detail=True), folder, storage_options,
                                RETRIES, BACKOFF_S)
        except FileNotFoundError as e:
            raise DataError(f"{folder}: cannot list it ({describe_error(e)}); {_hint(folder, storage_options)}") from e
        except RemoteReadError as e:
            raise DataError(str(e)) from e
        for e in entries:
            version = next((str(e[k]) for k in _VERSION_KEYS if e.get(k) not in (None, "")), "")
            listed[fs.unstrip_protocol(e["name"])] = {"size": e.get("size"), "version": version}
    missing = [u for u in urls if u not in listed]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{len(missing)} of {len(urls)} remote object(s) not found: {shown}")
    return [listed[u] for u in urls]
