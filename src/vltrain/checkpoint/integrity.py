"""A checkpoint that proves itself: the size and CRC-32 of each of its files, written when it is
committed and checked when a run resumes from it or a command opens it.

A file cut short (a full disk, a copy stopped half way) or changed by a flipped byte is found before
anything is read, so that resuming falls back to the newest intact checkpoint with a line naming the
damaged one, instead of failing deep inside ``torch.distributed.checkpoint``. The sums are made by
rank 0 at the commit, off the step's path. A checkpoint written before this has no manifest: only
what DCP's index tells is checked (no data file shorter than the bytes it records there).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from vltrain.checkpoint.storage import SafeFileSystemReader
from vltrain.errors import UserError

MANIFEST = "files.json"
COPIES = ("config.yaml", "tokenizer.json")
"""Copies of the run's config and tokenizer, kept so that a checkpoint folder rebuilds its model: not
summed, since a user may edit them (a path that moved, a setting read at export)."""
_CHUNK = 1 << 22


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def write_manifest(folder: Path) -> None:
    """``folder/files.json``: the size and CRC-32 of every file the resume reads, by name (recursive)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, *COPIES))
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "crc32": crc32(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1) + "\n")


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint in ``folder``, or None if every file is as it was saved (or,
    with no manifest, being older than manifests: if no data file is shorter than its index says)."""
    path = folder / MANIFEST
    if not path.is_file():
        return _cut_short(folder)
    try:
        entries = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} cannot be read"
    for name, want in entries.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{name} is {size:,} bytes, {want['size']:,} when it was saved"
        if crc32(p) != want["crc32"]:
            return f"{name} is not as it was saved (its CRC-32 differs)"
    return None


def _cut_short(folder: Path) -> str | None:
    """What a checkpoint older than manifests can tell: DCP's index (read through the allow-list)
    records where each tensor's bytes end in its data file, so a file cut short or missing is found; a
    changed byte is not. An index that cannot be read is left to the reader's own refusal."""
    try:
        metadata = SafeFileSystemReader(folder).read_metadata()
    except (OSError, UserError):
        return None
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if (size := p.stat().st_size) < end:
            return f"{name} is {size:,} bytes, its index reaches byte {end:,}"
    return None
