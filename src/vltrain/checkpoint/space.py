"""Disk space and the run folder: said before a save that may not fit, one message when it did not.

A full disk in the middle of a DCP save surfaces as a ``CheckpointException`` wrapping each rank's
failure (``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``, the zip
writer's view of a short write), then a second error from whatever wrote next (the plots). The
checkpoints already committed are intact: saves go to a temporary folder renamed into place.
So the user needs to hear one thing: which step failed, where, how much space is left, which
checkpoint to resume from, and what to do. ``DiskFull`` says it and exits with
``NO_SPACE_EXIT``; the same stop covers a run folder that cannot be written at all.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from vltrain.errors import UserError

NO_SPACE_EXIT = 74
"""The exit code of a run stopped because its folder is full or read-only (EX_IOERR)."""
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos", "file too large")
_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


class DiskFull(UserError):
    """A write into the run folder failed for lack of space (or of permission): nothing is lost
    but the step being saved; run again once there is room."""

    exit_code = NO_SPACE_EXIT


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def space_warning(folder: Path, complete: list[Path], keep: int) -> str | None:
    """A line to print before a save, when the last checkpoint would not fit in the free space."""
    if not complete:
        return None
    need, free = size_of(complete[-1]), free_bytes(folder)
    if free >= need:
        return None
    line = (f"checkpoint: {folder} has {_mb(free)} free, the last checkpoint ({complete[-1].name}) took "
            f"{_mb(need)}: the next save may fail")
    if 0 < keep <= len(complete):
        line += (f"; checkpoint.keep={keep} deletes {complete[-keep].name} only after the new one is "
                 "written, so that space is not free during the save")
    return line


def no_space(e: BaseException) -> BaseException | None:
    """The error in ``e`` (itself, a cause, or one of DCP's per-rank failures) that says the disk
    is full or the folder cannot be written; None when it is something else."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, *_DENIED):
            return x
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):
            todo.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())  # (error, trace)
        elif any(t in str(x).lower() for t in _NO_SPACE_TEXT):
            return x
        todo.extend([x.__cause__, x.__context__])
    return None


def disk_full(step: int, folder: Path, intact: Path | None, cause: BaseException) -> DiskFull:
    """The one message for a save that failed for lack of space (``cause``: what ``no_space`` found)."""
    kept = f"{intact} is intact and a rerun resumes from it" if intact else "no checkpoint of this run is complete yet"
    return DiskFull(
        f"checkpoint of step {step} could not be written: {folder} has {_mb(free_bytes(folder))} free "
        f"({_first_line(cause)}). {kept}. Free space there, lower checkpoint.keep, or give another run.dir, "
        f"then run the same command again (exit code {NO_SPACE_EXIT})")


def check_writable(run_dir: Path) -> None:
    """Stop at start-up when the run folder cannot be created or written."""
    probe = Path(run_dir) / f".write-test-{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as e:
        raise DiskFull(f"run.dir {run_dir} cannot be written ({_first_line(e)}); give a writable run.dir "
                       f"(exit code {NO_SPACE_EXIT})") from e


class QuietWrites:
    """Writes that follow a failure (metrics, TensorBoard, curves.png): a full disk is reported
    once, on stderr, and never masks the error that stopped the run."""

    def __init__(self) -> None:
        self.reported = False

    def run(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except (OSError, ValueError, AttributeError) as e:  # matplotlib's PNG writer fails as AttributeError
            if not self.reported:
                print(f"vltrain: {what} not written ({_first_line(e)}); further write errors not shown",
                      file=sys.stderr, flush=True)
            self.reported = True


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
