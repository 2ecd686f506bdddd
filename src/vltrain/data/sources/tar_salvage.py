"""What a damaged tar still holds: every complete member before the damage (and after it, where a
valid header follows a corrupt one), and an account of what was lost.

A tar is cut short when a download, an upload or the worker writing it dies (img2dataset's pool
leaves such shards); a header can be damaged in place. ``tarfile`` refuses the first and silently
stops at the second. Here every header is checked (``TarInfo.frombuf``: its checksum and fields);
at a bad one the walk looks for the next valid header on a block boundary and goes on from there.

A sample whose members straddle the damage is dropped: the cut member's sample, and a sample next
to a damaged header that lacks one of the extensions the shard's other samples have. The samples
lost are counted exactly where img2dataset's ``NNNNN.parquet`` beside the shard lists the keys it
wrote (``status == success``); otherwise only the dropped ones are known, and the count is a
lower bound.
"""

from __future__ import annotations

import tarfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

BLOCK = tarfile.BLOCKSIZE


class Member(NamedTuple):
    name: str
    offset: int  # its first header (a long name's, when there is one)
    offset_data: int
    size: int


class Damage(NamedTuple):
    offset: int  # the byte where the damage starts
    reason: str
    member: str | None  # the member cut short, when known
    resumed: int | None  # where the walk went on after a damaged header, if it did


def ends_cleanly(buf) -> bool:
    """Whether a tar ends as tar writers end one: with zero blocks (a file cut at a member
    boundary reads as a whole tar, short of its last samples, but has none)."""
    return len(buf) >= BLOCK and not buf[len(buf) - BLOCK :].strip(b"\0")


def salvage_members(buf) -> tuple[list[Member], list[Damage]]:
    """The complete regular-file members of a tar in ``buf``, and the damage found."""
    members: list[Member] = []
    damage: list[Damage] = []
    pos, long_name, first, end = 0, None, 0, len(buf)
    while True:
        if pos >= end:
            damage.append(Damage(end, f"cut short at byte {end}, after a whole member (no end-of-archive blocks)",
                                 None, None))
            break
        if pos + BLOCK > end:
            damage.append(Damage(pos, f"cut short at byte {end}, inside a header", None, None))
            break
        header = bytes(buf[pos : pos + BLOCK])
        if not header.strip(b"\0"):
            break  # the end-of-archive blocks
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            resumed = _next_header(buf, pos + BLOCK)
            damage.append(Damage(pos, f"unreadable header at byte {pos} ({e or 'bad checksum'})", None, resumed))
            if resumed is None:
                break
            pos, long_name = resumed, None
            continue
        name = long_name or info.name
        if pos + BLOCK + info.size > end:
            damage.append(Damage(pos, f"cut short at byte {end}, inside {name}", name, None))
            break
        if long_name is None:
            first = pos
        data = buf[pos + BLOCK : pos + BLOCK + info.size]
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif info.type == tarfile.XHDTYPE:
            long_name = _pax_path(bytes(data))
        else:
            if info.isreg():
                members.append(Member(name, first, pos + BLOCK, info.size))
            long_name = None
        pos += BLOCK + -(-info.size // BLOCK) * BLOCK
    return members, damage


def _next_header(buf, start: int) -> int | None:
    """The next block at or after ``start`` that is a valid ustar header."""
    at = start + 257
    while True:
        at = buf.find(b"ustar", at)
        if at < 0:
            return None
        pos = at - 257
        if pos % BLOCK == 0 and pos + BLOCK <= len(buf):
            try:
                tarfile.TarInfo.frombuf(bytes(buf[pos : pos + BLOCK]), "utf-8", "surrogateescape")
                return pos
            except tarfile.HeaderError:
                pass
        at += 1


def _pax_path(data: bytes) -> str | None:
    for record in data.split(b"\n"):
        _, _, field = record.partition(b" ")
        if field.startswith(b"path="):
            return field[5:].decode("utf-8", "surrogateescape")
    return None


def key_of(name: str) -> str | None:
    base = name.rsplit("/", 1)[-1]
    if "." not in base or base.startswith("."):
        return None
    return name[: len(name) - len(base)] + base.split(".", 1)[0]


def straddling(members: list[Member], damage: list[Damage]) -> set[str]:
    """The keys of samples the damage cut through (see the module's docstring)."""
    exts: dict[str, set[str]] = {}
    for m in members:
        key = key_of(m.name)
        if key is not None:
            exts.setdefault(key, set()).add(m.name.rsplit(".", 1)[-1].lower())
    usual = Counter(frozenset(e) for e in exts.values()).most_common(1)
    usual_set = usual[0][0] if usual else frozenset()
    out = set()
    for d in damage:
        if d.member is not None and key_of(d.member) is not None:
            out.add(key_of(d.member))
        near = [m for m in members if m.offset < d.offset][-1:] + \
            [m for m in members if d.resumed is not None and m.offset >= d.resumed][:1]
        out |= {k for m in near for k in [key_of(m.name)] if k is not None and exts[k] < usual_set}
    return out


def listed_keys(shard: Path) -> set[str] | None:
    """The keys img2dataset wrote to ``shard``, from the ``.parquet`` it writes beside it; None when
    there is none (or it is unreadable, or not img2dataset's)."""
    listing = shard.with_suffix(".parquet")
    if not listing.is_file():
        return None
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(listing, columns=["key", "status"])
    except Exception:  # no pyarrow, a damaged file, other columns: the count stays a lower bound
        return None
    return {k for k, s in zip(table.column("key").to_pylist(), table.column("status").to_pylist())
            if s == "success" and k is not None}


def account(shard: Path, damage: list[Damage], kept: list[str], dropped: set[str]) -> list:
    """One problem for a damaged shard: [where, why, "error", {offset, kept, lost, exact}]."""
    expected = listed_keys(shard)
    if expected is not None:
        lost, exact = len(expected - set(kept)), True
        how = f"{lost} lost (of the {len(expected)} {shard.with_suffix('.parquet').name} lists)"
    else:
        lost, exact = len(dropped), False
        tail = " and the rest of the file" if any(d.member is not None or d.resumed is None for d in damage) else ""
        how = f"at least {lost} lost{tail} (no img2dataset {shard.with_suffix('.parquet').name} beside it to count them)"
    first = damage[0]
    more = f" (and {len(damage) - 1} more damaged place(s))" if len(damage) > 1 else ""
    why = f"damaged tar: {first.reason}{more}; {len(kept)} samples kept, {how}"
    return [f"byte {first.offset}", why, "error", {"offset": first.offset, "kept": len(kept), "lost": lost,
                                                   "exact": exact}]
