"""A bounded local cache of whole remote objects, shared by every worker and rank of a node.

A GET per sample costs tens of milliseconds against object storage, so shards are not read in
place: each is downloaded whole (ranged chunks, several at once) into the cache, then read like a
local shard. A wait for another process's download has a deadline.
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
from typing import Any, BinaryIO, Iterable, Iterator

from vltrain.data.sources import filelock
from vltrain.data.sources.remote import (
    BACKOFF_S,
    RETRIES,
    RemoteReadError,
    Unreachable,
    describe_error,
    filesystem,
    missing_error,
    retrying,
    stat_remote,
    store_of,
)
from vltrain.errors import DataError

CHUNK_BYTES = 16 << 20
PARALLEL_CHUNKS = 4
"""A download is ranged GETs of CHUNK_BYTES, this many in flight: one GET stream is often slower
than the network, and a failed chunk is retried alone."""
LOCK_WAIT_S = 1800.0
"""The longest a process waits for another's download (which touches its lock after every chunk,
so that a lock from a dead process on another host is taken over after filelock.STALE_S)."""
OPEN_TRIES = 3
"""Tries to open an object that another process downloaded and a third evicted before this one
could open it (each try may download it here, which cannot fail so): more means a cache far too
small for the shards being read at once."""
DOWN_S = 30.0
"""After a read that failed past its retries, further reads from the same store (endpoint and
bucket, or host) that the cache cannot answer fail at once for this long, then are tried again.
Without it a storage outage costs every sample, and every replacement of it, the full retries."""


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
    after it is unlinked, so a reader reads through a descriptor (``hold()``), not by opening
    ``local()``'s path, which may be gone by then; but the unlinked file keeps its blocks while it
    is open, so a process holds one at a time. Downloads in progress are not counted against the limit. So the
    disk held is at most the limit plus one shard per process that reads (open or downloading)
    and one per download ahead (``prefetch``): docs/formats.md, "The shard cache".

    A store whose read failed past the retries is remembered as down for ``DOWN_S`` (per
    process): reads from it that need a download fail at once with that failure's message, while
    what is cached reads on.
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
        self._down: dict[str, tuple[float, str]] = {}
        """store -> (monotonic time of the failure, its message)"""
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
        """A local file holding the whole object at ``url``, downloaded first when needed. Another
        process may evict it at any time: to read it, use ``open()`` or ``open_fd()``."""
        os.close(self.open_fd(url, stat))
        return self.path_for(url)

    def open_fd(self, url: str, stat: dict | None = None) -> int:
        """The whole object at ``url`` opened read-only, downloaded first when needed; the
        descriptor outlives an eviction of the object."""
        if os.getpid() != self._pid:
            self._reset()
        with self._mutex:
            pending = self._pending.get(url)
        if pending is not None:
            with contextlib.suppress(Exception):  # its error, if any, is raised again below
                pending.result()
        return self._open(url, stat)

    def _open(self, url: str, stat: dict | None) -> int:
        """A cached copy is opened before it is checked, and a download before it is renamed into
        place: never by a path checked earlier, which another process's download may evict in
        between (a reader meeting FileNotFoundError would replace a sample in this run only)."""
        path = self.path_for(url)
        want = stat or self._known.get(url)
        for _ in range(OPEN_TRIES):
            fd = None if want is None else self._open_fresh(path, want)
            if fd is not None:
                return fd
            with self._outage(url):
                want = want or self._stat(url)
                fd = self._fetch_locked(url, path, want)
            if fd is not None:
                return fd
        raise RemoteReadError(f"{url}: evicted from {self.root} by other processes {OPEN_TRIES} times before "
                              "it could be opened; raise data.cache_limit_gb")

    def _open_fresh(self, path: Path, want: dict) -> int | None:
        """``path`` opened if it holds the object ``want`` describes (its record says so, and the
        path still names the opened file), counted as a hit; else None."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if self._fresh(path, want) and os.fstat(fd).st_ino == path.stat().st_ino:
                filelock.touch(path)  # its last use, for LRU eviction
                self._count(hits=1)
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
        return None

    @contextlib.contextmanager
    def _outage(self, url: str) -> Iterator[None]:
        """Fail at once while ``url``'s store is remembered as down; remember it when a read
        fails past its retries."""
        store = store_of(url, self.storage_options)
        with self._mutex:
            since, why = self._down.get(store, (None, ""))
        if since is not None and time.monotonic() - since < DOWN_S:
            raise Unreachable(f"{url}: not tried, {store} failed {time.monotonic() - since:.0f} s ago and reads "
                              f"from it fail at once for {DOWN_S:.0f} s. That failure: {why}")
        try:
            yield
        except Unreachable as e:
            with self._mutex:
                self._down[store] = (time.monotonic(), str(e))
            raise

    def open(self, url: str, stat: dict | None = None) -> BinaryIO:
        """``open_fd(url)`` as a file; the open file outlives an eviction of the object."""
        return os.fdopen(self.open_fd(url, stat), "rb")

    def hold(self, url: str, stat: dict | None = None) -> int:
        """A read-only descriptor on ``url``'s cached copy: the one cached file this process holds.

        An evicted file keeps its blocks while a descriptor holds it, outside the limit's account,
        so a process that held every file it read would fill the disk whatever the limit says. A
        process holds one at a time instead: the previous one is closed before ``url`` is looked
        up (and perhaps downloaded), so it never holds an evicted file while it downloads another.
        Reading on in the same file costs nothing; moving to another costs one cache lookup. The
        descriptor is valid until the next ``hold`` or ``release`` in this thread.
        """
        key = (str(self.root), url)
        if _held.key == key and _held.pid == os.getpid():
            return _held.fd
        release()
        fd = self.open_fd(url, stat)
        _held.key, _held.pid, _held.fd = key, os.getpid(), fd
        return fd

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
            with self._outage(url):
                return retrying(lambda: fs.cat_file(path), url, self.storage_options, self.retries, self.backoff_s)
        except FileNotFoundError as e:
            raise RemoteReadError(f"{url}: no such object ({describe_error(e)})") from e

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
            os.close(self._open(url, None))
        except Exception:
            self._count(prefetch_errors=1)

    def _stat(self, url: str) -> dict:
        known = self._known.get(url)
        if known is None:
            try:
                known = stat_remote(url, self.storage_options, retries=self.retries, backoff_s=self.backoff_s)
            except DataError as e:
                if isinstance(e.__cause__, Unreachable):  # a read's failure, to remember: not a bad source
                    raise e.__cause__ from None
                raise
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

    def _fetch_locked(self, url: str, path: Path, want: dict) -> int | None:
        """Download under the object's lock, or wait for the process that holds it; the object
        opened, or None when another process's download of it was evicted before it was opened."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name.split("-", 1)[0] + ".lock")
        with filelock.exclusive(lock, self.lock_wait_s, lambda: self._fresh(path, want), f"download {url}") as mine:
            fd = self._open_fresh(path, want)
            if fd is None and mine:
                fd = self._download(url, path, want, lock)
                self._evict(keep=path)
        return fd

    def _download(self, url: str, path: Path, want: dict, lock: Path) -> int:
        """Stream into a temporary file, then rename it into place and record what it is; the file
        opened for reading before the rename, so that no eviction can take it from this process."""
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
            reader = os.open(tmp, os.O_RDONLY)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_meta(path))  # the old record goes first: never an old record over new bytes
                os.replace(tmp, path)
                _write_json(_meta(path), {"url": url, "size": size, "version": want.get("version", "")})
            except BaseException:
                os.close(reader)
                raise
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._count(downloads=1, bytes_downloaded=size)
        return reader

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
            return retrying(lambda: fs.cat_file(rpath, start=start, end=end), url, self.storage_options,
                             self.retries, self.backoff_s)
        except FileNotFoundError as e:
            raise missing_error(url, e, self.storage_options) from e

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


class _Held(threading.local):
    """The cached file a process holds open for reading (``ShardCache.hold``): one per process
    (per reading thread, should a process read from several), whatever the number of sources and
    caches, so that the disk bound counts one per process. Per thread, so that no thread closes a
    descriptor another is reading from."""

    key: tuple[str, str] | None = None
    pid: int | None = None
    fd: int = -1


_held = _Held()


def release() -> None:
    """Close the cached file this process holds, if any.

    A forked loader worker inherits its parent's descriptor, a copy that would keep the file's
    blocks for the worker's life: it is closed in the worker too."""
    if _held.key is not None:
        fd, _held.key, _held.pid, _held.fd = _held.fd, None, None, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _meta(path: Path) -> Path:
    return path.with_name(path.name.split("-", 1)[0] + ".meta.json")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
