"""One builder among many processes: a lock file that works on network file systems.

Many ranks (and their loader workers) open the same data at once, on one node or on many that
share a file system. Whatever is derived from the data once (a shard's member index, a source's
sample index) is built by one of them; the others wait and read the result. The lock is a file
created with O_EXCL, which holds on network file systems where ``flock`` may not. A lock left by
a process that died is taken over: at once when its owner ran on this host and is gone, else
after ``LOCK_STALE_S``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Callable, TypeVar

from vltrain.errors import DataError

T = TypeVar("T")

LOCK_STALE_S = 600.0
"""A lock file this old whose builder cannot be checked is taken to be left by a crash."""


def build_once(path: Path, read_fresh: Callable[[], T | None], build: Callable[[], T], *,
               what: str, wait_s: float = 1800.0) -> T:
    """``read_fresh()`` if it finds a result, else ``build()`` by exactly one process.

    ``build`` must write its result atomically (to a temporary name, then ``os.replace``), so a
    waiter's ``read_fresh`` sees either nothing or the whole result.
    """
    found = read_fresh()
    if found is not None:
        return found
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            found = read_fresh()
            if found is not None:
                return found
            if stale(lock):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            if time.monotonic() > deadline:
                raise DataError(
                    f"waited {wait_s:.0f}s for another process to {what} (lock {lock}); "
                    "if no vltrain process is running, delete the lock file"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
            os.close(fd)
            found = read_fresh()  # finished by another process between our read and our lock
            return found if found is not None else build()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)


def stale(lock: Path) -> bool:
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
    return age > LOCK_STALE_S


def private_tmp(path: Path) -> Path:
    """A temporary name beside ``path`` that no other process (on any host) writes."""
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
