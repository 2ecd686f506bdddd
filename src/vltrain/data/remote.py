"""Remote objects (``s3://``, ``gs://``, ``https://``, any fsspec URL) read as whole local files.

A GET per sample costs tens of milliseconds against object storage, so shards are not read in
place: each is downloaded whole (ranged chunks, several at once) into a bounded local cache that
every worker and rank of a node shares, then read like a local shard. Small objects (a manifest,
a manifest row's image) are read directly. Nothing may hang a run: every request has connect and
read timeouts, transient failures are retried a bounded number of times with backoff, and a wait
for another process's download has a deadline.

Errors: ``DataError`` (the run stops with its message) for a missing bucket or object where one
is required (``stat_remote``, ``expand_remote``, ``ShardCache.local``), denied access anywhere, a
network failure while opening sources (``stat_remote``, ``expand_remote``), a download lock held
past its deadline. ``RemoteReadError`` (an ``OSError``) for a network failure that outlasted the
retries in ``ShardCache.local``/``open``/``read_bytes``, and a missing object in ``read_bytes``: a
per-sample reader replaces the sample, as for a missing local image, and the bad-sample limit
stops a run whose storage went away. fsspec and its backends are imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from vltrain.data import filelock
from vltrain.data.sources import expand_braces
from vltrain.errors import DataError

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
"""Longest wait for a connection, and for the next bytes of a response (not for a whole object)."""
RETRIES = 2
"""Retries of one request after a transient failure. Under them botocore makes 2 attempts (s3fs's
own retry loop is turned off), so a server that accepts connections and then stays silent fails a
request after (1 + RETRIES) x 2 x READ_TIMEOUT_S, about 3 minutes; a refused connection in seconds."""
BACKOFF_S = 0.5
"""First retry delay; it doubles with each retry."""
CHUNK_BYTES = 16 << 20
PARALLEL_CHUNKS = 4
"""A download is ranged GETs of CHUNK_BYTES, this many in flight: one GET stream is often slower
than the network, and a failed chunk is retried alone."""
LOCK_WAIT_S = 1800.0
"""The longest a process waits for another's download (which touches its lock after every chunk,
so that a lock from a dead process on another host is taken over after filelock.STALE_S)."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "fsspec", "http")


class RemoteReadError(OSError):
    """A remote object could not be read now; per-sample readers replace the sample."""


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


def _retrying(fn: Callable[[], Any], url: str, options: dict | None, retries: int, backoff_s: float) -> Any:
    """``fn()``, retried on transient errors; missing objects raise FileNotFoundError at once."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            kind = _kind(e)
            if kind is None or kind == "missing":
                raise
            if kind == "denied":
                raise DataError(f"{url}: access denied ({_short(e)}); {_hint(url, options)}") from e
            if attempt == retries:
                raise RemoteReadError(
                    f"{url}: not readable after {retries + 1} attempts ({_short(e)}); {_hint(url, options)}"
                ) from e
            time.sleep(backoff_s * 2**attempt)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _missing(url: str, e: BaseException, options: dict | None) -> DataError:
    return DataError(f"{url}: no such object or bucket ({_short(e)}); {_hint(url, options)}")


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
            found = _retrying(lambda: fs.glob(path), url, storage_options, retries, backoff_s)
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
        info = _retrying(lambda: fs.info(path), url, storage_options, retries, backoff_s)
    except FileNotFoundError as e:
        raise _missing(url, e, storage_options) from e
    except RemoteReadError as e:
        raise DataError(str(e)) from e
    if info.get("type") == "directory":
        raise DataError(f"{url}: is a folder, not an object; name the objects in it, e.g. {url.rstrip('/')}/*.tar")
    version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) not in (None, "")), "")
    size = info.get("size")
    return {"size": None if size is None else int(size), "version": version}


@dataclass
class CacheStats:
    """What one process's ShardCache did: ``downloads`` counts whole-object fetches (GETs)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    prefetch_errors: int = 0


class ShardCache:
    """Whole remote objects in ``cache_dir/remote``, at most ``limit_bytes`` of them, LRU evicted.

    Safe to share between the DataLoader workers and ranks of a node: one process downloads an
    object (under an O_EXCL lock file, which works on network file systems too) while the others
    wait for it. A cached object records the remote size and version; the remote is asked once
    per URL per process (or never, when the caller passes the ``stat`` it indexed with), and a
    changed object is downloaded again.

    Eviction deletes files other processes may be reading. On Linux an open file stays readable
    after it is unlinked, so a reader should hold one open file per shard (``open()``), not
    reopen ``local()``'s path per sample. Downloads in progress are not counted against the
    limit, so the cache may exceed it by what is being fetched.
    """

    def __init__(self, cache_dir: str | os.PathLike, limit_bytes: int, storage_options: dict | None = None, *,
                 retries: int = RETRIES, backoff_s: float = BACKOFF_S, ahead: int = 2,
                 lock_wait_s: float = LOCK_WAIT_S, chunk_bytes: int = CHUNK_BYTES):
        if limit_bytes <= 0:
            raise DataError(f"the remote shard cache limit must be > 0 bytes, got {limit_bytes}")
        self.root = Path(cache_dir) / "remote"
        self.limit_bytes = int(limit_bytes)
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff_s, self.ahead = retries, backoff_s, max(1, ahead)
        self.lock_wait_s, self.chunk_bytes = lock_wait_s, chunk_bytes
        self.stats = CacheStats()
        self._known: dict[str, dict] = {}
        self._reset()

    def _reset(self) -> None:
        """Per-process state: threads and filesystem clients do not survive a fork."""
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[str, concurrent.futures.Future] = {}

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_mutex", "_pool", "_pending")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- the public surface -----------------------------------------------------------------

    def path_for(self, url: str) -> Path:
        """Where ``url`` is (or would be) cached: ``HASH-NAME``, NAME the object's base name."""
        digest = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
        name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
        return self.root / f"{digest}-{name}"

    def local(self, url: str, stat: dict | None = None) -> Path:
        """A local file holding the whole object at ``url``, downloaded first when needed."""
        if os.getpid() != self._pid:
            self._reset()
        with self._mutex:
            pending = self._pending.get(url)
        if pending is not None:
            with contextlib.suppress(Exception):  # its error, if any, is raised again below
                pending.result()
        return self._local(url, stat)

    def _local(self, url: str, stat: dict | None) -> Path:
        path = self.path_for(url)
        want = stat or self._stat(url)
        if self._fresh(path, want):
            filelock.touch(path)  # its last use, for LRU eviction
            self._count(hits=1)
            return path
        return self._fetch_locked(url, path, want)

    def open(self, url: str, stat: dict | None = None) -> BinaryIO:
        """``local(url)`` opened for reading; the open file outlives an eviction of the object."""
        for _ in range(3):
            try:
                return open(self.local(url, stat), "rb")
            except FileNotFoundError:
                continue  # evicted by another process between the two calls
        raise RemoteReadError(f"{url}: evicted from {self.root} as soon as fetched; raise data.cache_limit_gb")

    def prefetch(self, urls: Iterable[str]) -> int:
        """Start downloading ``urls`` in the background, in order; how many were started.

        At most ``ahead`` are queued or downloading at a time: URLs past that are not taken
        (call again with the next ones when a shard is done). A failed prefetch is counted in
        ``stats.prefetch_errors`` and leaves nothing behind; ``local()`` then raises its error.
        """
        if os.getpid() != self._pid:
            self._reset()
        started = 0
        with self._mutex:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.ahead, thread_name_prefix="vltrain-prefetch")
            self._pending = {u: f for u, f in self._pending.items() if not f.done()}
            for url in urls:
                if url in self._pending:
                    continue
                if len(self._pending) >= self.ahead:
                    break
                self._pending[url] = self._pool.submit(self._prefetch_one, url)
                started += 1
        return started

    def read_bytes(self, url: str) -> bytes:
        """A small object read whole, not cached (a manifest row's image); RemoteReadError when
        it is missing or the network fails past the retries."""
        fs, path = filesystem(url, self.storage_options)
        try:
            return _retrying(lambda: fs.cat_file(path), url, self.storage_options, self.retries, self.backoff_s)
        except FileNotFoundError as e:
            raise RemoteReadError(f"{url}: no such object ({_short(e)})") from e

    def usage(self) -> int:
        """Bytes of complete cached objects."""
        return sum(size for _, size, _ in self._entries())

    def close(self) -> None:
        """Stop prefetching: queued downloads are dropped, running ones finish."""
        with self._mutex:
            pool, self._pool, self._pending = self._pool, None, {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- fetching ---------------------------------------------------------------------------

    def _count(self, **add: int) -> None:
        with self._mutex:
            for key, n in add.items():
                setattr(self.stats, key, getattr(self.stats, key) + n)

    def _prefetch_one(self, url: str) -> None:
        try:
            self._local(url, None)
        except Exception:
            self._count(prefetch_errors=1)

    def _stat(self, url: str) -> dict:
        known = self._known.get(url)
        if known is None:
            known = stat_remote(url, self.storage_options, retries=self.retries, backoff_s=self.backoff_s)
            self._known[url] = known
        return known

    def _fresh(self, path: Path, want: dict) -> bool:
        try:
            with open(_meta(path), encoding="utf-8") as f:
                have = json.load(f)
            size = path.stat().st_size
        except (OSError, ValueError):
            return False
        if want.get("size") is not None and (have.get("size"), size) != (want["size"], want["size"]):
            return False
        return not (want.get("version") and have.get("version") != want["version"])

    def _fetch_locked(self, url: str, path: Path, want: dict) -> Path:
        """Download under the object's lock, or wait for the process that holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name.split("-", 1)[0] + ".lock")
        with filelock.exclusive(lock, self.lock_wait_s, lambda: self._fresh(path, want), f"download {url}") as mine:
            if mine and not self._fresh(path, want):
                self._download(url, path, want, lock)
                self._evict(keep=path)
                return path
        filelock.touch(path)  # its last use, for LRU eviction
        self._count(hits=1)
        return path

    def _download(self, url: str, path: Path, want: dict, lock: Path) -> None:
        """Stream into a temporary file, then rename it into place and record what it is."""
        fs, rpath = filesystem(url, self.storage_options)
        tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
        size = want.get("size")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
            try:
                if size is None:
                    data = self._get(fs, rpath, url, None, None)
                    os.write(fd, data)
                    size = len(data)
                else:
                    self._get_chunks(fs, rpath, url, size, fd, lock)
            finally:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_meta(path))  # the old record goes first: never an old record over new bytes
            os.replace(tmp, path)
            _write_json(_meta(path), {"url": url, "size": size, "version": want.get("version", "")})
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._count(downloads=1, bytes_downloaded=size)

    def _get_chunks(self, fs: Any, rpath: str, url: str, size: int, fd: int, lock: Path) -> None:
        def one(start: int) -> None:
            end = min(start + self.chunk_bytes, size)
            data = self._get(fs, rpath, url, start, end)
            if len(data) != end - start:
                raise RemoteReadError(f"{url}: changed while downloading (bytes {start}..{end} came back "
                                      f"{len(data)} long); it will be fetched again on next use")
            os.pwrite(fd, data, start)
            filelock.touch(lock)

        starts = range(0, size, self.chunk_bytes)
        pool = concurrent.futures.ThreadPoolExecutor(max(1, min(PARALLEL_CHUNKS, len(starts))))
        try:
            for future in [pool.submit(one, s) for s in starts]:
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _get(self, fs: Any, rpath: str, url: str, start: int | None, end: int | None) -> bytes:
        try:
            return _retrying(lambda: fs.cat_file(rpath, start=start, end=end), url, self.storage_options,
                             self.retries, self.backoff_s)
        except FileNotFoundError as e:
            raise _missing(url, e, self.storage_options) from e

    # -- eviction ---------------------------------------------------------------------------

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every complete cached object."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                if not re.fullmatch(r"[0-9a-f]{16}-[^/]*", p.name) or p.name.endswith(".tmp"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    out.append((st.st_mtime, st.st_size, p))
        return out

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used objects until the cache fits its limit (never ``keep``)."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries:
            if total <= self.limit_bytes:
                break
            if p == keep:
                continue
            for f in (_meta(p), p):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)
            total -= size
            self._count(evictions=1)


def _meta(path: Path) -> Path:
    return path.with_name(path.name.split("-", 1)[0] + ".meta.json")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
