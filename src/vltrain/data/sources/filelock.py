"""A lock file for work that one process of many should do (build an index, download a shard).

Many ranks and their loader workers open the same data at once; what is derived from it once
(a shard's member index, a source's sample index, a downloaded shard) is made by one of them.

The lock is a file created with O_EXCL, which works on network file systems where flock may not.
It names its owner (host and pid), so a lock left by a process that died is taken over: at once
when the owner ran on this host and is gone, else once the file is ``stale_s`` old. An owner doing
long work keeps its lock young with ``touch``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from vltrain.errors import DataError

STALE_S = 600.0
T = TypeVar("T")


@contextlib.contextmanager
def exclusive(lock: Path, wait_s: float, done: Callable[[], bool], what: str,
              stale_s: float = STALE_S) -> Iterator[bool]:
    """Yields True holding ``lock``, or False as soon as ``done()`` says another process did it.

    Waiting longer than ``wait_s`` is a DataError naming ``what`` and the lock file to delete.
    """
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if done():
                yield False
                return
            if stale(lock, stale_s):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            if time.monotonic() > deadline:
                raise DataError(f"waited {wait_s:.0f}s for another process to {what} (lock {lock}); "
                                "if no vltrain process is running, delete the lock file") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
            os.close(fd)
            yield True
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)


def touch(lock: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(lock)


def stale(lock: Path, stale_s: float = STALE_S) -> bool:
    """The owner on this host is gone, or the owner elsewhere has not touched the lock in ``stale_s``."""
    try:
        owner = lock.read_text().split()
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return False  # just released, or being written: look again
    if len(owner) == 2 and owner[0] == socket.gethostname() and owner[1].isdigit():
        try:
            os.kill(int(owner[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return age > stale_s


def build_once(path: Path, read_fresh: Callable[[], T | None], build: Callable[[], T], *,
               what: str, wait_s: float = 1800.0) -> T:
    """``read_fresh()`` if it finds a result, else ``build()`` by exactly one process while the
    others wait and then read it. ``build`` writes its result atomically (``private_tmp``, then
    ``os.replace``), so a waiter sees either nothing or the whole result."""
    found = read_fresh()
    if found is not None:
        return found
    path.parent.mkdir(parents=True, exist_ok=True)
    box: list = []

    def done() -> bool:
        box[:] = [read_fresh()]
        return box[0] is not None

    with exclusive(path.with_name(path.name + ".lock"), wait_s, done, what) as mine:
        if not mine:
            return box[0]
        found = read_fresh()  # finished by another process between our read and our lock
        return found if found is not None else build()


def private_tmp(path: Path) -> Path:
    """A temporary name beside ``path`` that no other process (on any host) writes."""
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
