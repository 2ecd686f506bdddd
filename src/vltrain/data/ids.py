"""Stable sample ids: a string key per sample (given, or derived) and its int64 form for tensors."""

from __future__ import annotations

import hashlib


def stable_uid(key: str) -> int:
    """A non-negative int64 from a sample key; stable across processes, runs and machines."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def derived_key(source: str, position: int, image: str | None, text: str | None) -> str:
    """Key of a sample without a given id: its source, its position, and a hash of its content."""
    h = hashlib.blake2b(digest_size=6)
    h.update((image or "").encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update((text or "").encode("utf-8", "surrogatepass"))
    return f"{source}:{position}:{h.hexdigest()}"
