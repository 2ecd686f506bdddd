"""Scanning a tar shard once into its samples: members ``KEY.jpg|jpeg|png|webp``, ``KEY.txt``,
``KEY.json`` grouped by key.

Three ways, fastest first, each leaving to the next what it does not know, so that a shard reads
the same whichever way it went:

- in bulk (``_bulk``), the usual shard: plain ustar/GNU headers with octal sizes, and a sample's
  members one after another. The headers are found by their magic over a memory map and checked
  to chain from the first block to the end of the archive; names, keys, extensions and the
  grouping into samples are numpy operations on all headers at once; the captions are joined
  into one buffer to be checked, and the JSON members parsed in one call.
- header by header (``walk_members``): GNU long names, pax records, ustar prefixes, a sample's
  members apart.
- what a damaged tar still holds (``tar_salvage``): its complete samples, and the damage as one
  problem with the samples kept and lost;
- ``tarfile``: anything else, and what is wrong with a file that is no tar.

A sample that needs a closer look (a caption blank or not UTF-8, JSON that is not valid, no image
and no text, ...) goes through the same checks (``_sample``) whichever way it was found.
"""

from __future__ import annotations

import json
import mmap
import tarfile
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from vltrain.data.sources.json_bulk import SEPARATOR, loads_objects
from vltrain.data.sources.manifests import REGIONS_KEY, is_unicode
from vltrain.data.sources.tar_salvage import Damage, account, ends_cleanly, key_of, salvage_members, straddling
from vltrain.errors import DataError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
BLOCK = tarfile.BLOCKSIZE


class ShardScan(NamedTuple):
    """A shard's usable samples in member order, as columns; and the problems found in it."""

    start: np.ndarray  # int64: the sample's members, headers included, span [start, end)
    end: np.ndarray
    has_image: np.ndarray  # bool
    has_text: np.ndarray
    samples: list | None  # [key, id, [offset, size, member] | None, text | None, regions] each, when asked for
    problems: list[list[str]]


def scan_shard(shard: Path, samples: bool = False) -> ShardScan:
    """Every usable sample of a tar, and the problems found; ``samples``: with keys, ids, image
    references and captions (else the columns alone, which is all the sample index needs)."""
    try:
        with open(shard, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped when let go: numpy may view it
    except ValueError:
        buf = b""  # an empty file: mmap refuses it
    except OSError:
        buf = None  # tarfile says what is wrong
    if buf is not None:
        try:
            if not ends_cleanly(buf):
                raise UnusualHeader  # cut short, or empty
            layout = _bulk(buf)
            if layout is not None:
                return _layout_scan(buf, layout, samples)
            found = _scan(list(walk_members(buf)), lambda m: buf[m.offset_data : m.offset_data + m.size])
            return _lists_scan(*found, samples)
        except (UnusualHeader, ValueError, OSError):
            pass  # a damaged file, or an unusual header
        salvaged = _salvaged(shard, buf, samples)
        if salvaged is not None:
            return salvaged
    try:
        with tarfile.open(shard, "r:") as tar:
            members = [_Member(i.name, i.offset, i.offset_data, i.size) for i in tar if i.isfile()]
            infos = {i.offset_data: i for i in tar.getmembers()}
            return _lists_scan(*_scan(members, lambda m: tar.extractfile(infos[m.offset_data]).read()), samples)
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{shard}: not a readable tar file ({e})") from e


def _salvaged(shard: Path, buf, keep_samples: bool) -> ShardScan | None:
    """The scan of a damaged tar (``tar_salvage``); None for one without damage (an unusual header:
    tarfile reads it) or for a file that is no tar at all (tarfile says so)."""
    if not len(buf):
        members, damage = [], [Damage(0, "empty file", None, None)]
    else:
        members, damage = salvage_members(buf)
        if not damage or (not members and damage[0].offset == 0 and damage[0].member is None
                          and damage[0].resumed is None):
            return None
    dropped = straddling(members, damage)
    whole = [m for m in members if key_of(m.name) not in dropped]
    found, problems = _scan(whole, lambda m: buf[m.offset_data : m.offset_data + m.size])
    kept = list(dict.fromkeys(k for m in whole for k in [key_of(m.name)] if k is not None))
    problems.append(account(shard, damage, kept, dropped))
    return _lists_scan(found, problems, keep_samples)


def _lists_scan(samples: list[list], problems: list, keep_samples: bool) -> ShardScan:
    def column(k: int, dtype) -> np.ndarray:
        return np.array([s[k] for s in samples], dtype=dtype)

    return ShardScan(column(5, np.int64), column(6, np.int64), np.array([s[2] is not None for s in samples], bool),
                     np.array([s[3] is not None for s in samples], bool),
                     [s[:5] for s in samples] if keep_samples else None, problems)


# -- header by header -----------------------------------------------------------------------------


class UnusualHeader(Exception):
    """A header the direct walk leaves to tarfile."""


class _Member(NamedTuple):
    name: str
    offset: int  # its first header (a long name's, when there is one)
    offset_data: int
    size: int


def walk_members(buf) -> Iterator[_Member]:
    """The regular-file members of a tar in ``buf`` (bytes or a memory map), from their headers."""
    pos, long_name, pending, first = 0, None, False, 0
    while pos + BLOCK <= len(buf):
        header = buf[pos : pos + BLOCK]
        if not header.strip(b"\0"):
            break
        if header[257:262] != b"ustar" or not _checksum_ok(header):
            raise UnusualHeader  # not a ustar/GNU/pax header, or a damaged one: tarfile or the salvage reads it
        if header[124] & 0x80:
            raise UnusualHeader  # base-256 size
        size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        if pos + BLOCK + size > len(buf):
            raise UnusualHeader  # truncated
        if not pending:
            first = pos  # a member's headers start here (a long name or pax record first)
        kind = header[156:157]
        name = long_name or (header[345:500].split(b"\0", 1)[0] + b"/" if header[257:262] == b"ustar"
                             and header[345:346] != b"\0" else b"") + header[:100].split(b"\0", 1)[0]
        long_name, pending = None, kind in (b"L", b"x")
        if kind == b"L":
            long_name = buf[pos + BLOCK : pos + BLOCK + size].split(b"\0", 1)[0]
        elif kind == b"x":
            long_name = _pax_path(buf[pos + BLOCK : pos + BLOCK + size])
        elif kind in (b"0", b"\0", b"7"):
            yield _Member(name.decode("utf-8", "surrogateescape"), first, pos + BLOCK, size)
        elif kind not in (b"5", b"g"):
            raise UnusualHeader
        pos += BLOCK + -(-size // BLOCK) * BLOCK


def _checksum_ok(header: bytes) -> bool:
    stored = header[148:156].split(b"\0", 1)[0].strip()
    return bool(stored) and int(stored, 8) == sum(header[:148]) + 8 * 32 + sum(header[156:])


def _pax_path(data: bytes) -> bytes | None:
    for record in data.split(b"\n"):
        _, _, field = record.partition(b" ")
        if field.startswith(b"path="):
            return field[5:]
    return None


def _groups(members: list[_Member]) -> dict[str, dict[str, _Member]]:
    """{key: {extension: member}}, keys in order of first appearance; a name without an extension
    is no sample's."""
    groups: dict[str, dict[str, _Member]] = {}
    for m in members:
        base = m.name.rsplit("/", 1)[-1]
        if "." not in base or base.startswith("."):
            continue
        stem, ext = base.split(".", 1)
        groups.setdefault(m.name[: len(m.name) - len(base)] + stem, {})[ext.lower()] = m
    return groups


def _scan(members: list[_Member], read) -> tuple[list[list], list[list[str]]]:
    """[key, id, image ref, text, regions, start, end] of each usable sample; and the problems."""
    problems: list[list[str]] = []
    samples = []
    for key, group in _groups(members).items():
        sample = _sample(read, key, group, problems)
        if sample is not None:
            start = min(m.offset for m in group.values())
            end = max(m.offset_data + -(-m.size // BLOCK) * BLOCK for m in group.values())
            samples.append(sample + [start, end])
    return samples, problems


def _sample(read, key: str, members: dict, problems: list) -> list | None:
    image = next((members[e] for e in IMAGE_EXTS if e in members), None)
    text = sid = regions = None
    if "txt" in members:
        raw = read(members["txt"])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append([key, f"text is not valid UTF-8 (byte {e.start})", "error"])
            return None
        if not text.strip():
            if image is not None:
                problems.append([key, "empty text (sample used as image-only)", "warning"])
            text = None
    if "json" in members:
        try:
            meta = json.loads(read(members["json"]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append([key, f"{key}.json is not valid JSON ({e})", "error"])
            return None
        sid = _given_id(meta.get("id") if isinstance(meta, dict) else None)
        regions = meta.get(REGIONS_KEY) if isinstance(meta, dict) else None
        if sid is not None and not is_unicode(sid):
            problems.append([key, "id is not valid UTF-8", "error"])
            return None
    if image is None and text is None:
        problems.append([key, f"no image ({'|'.join(IMAGE_EXTS)}) and no text (txt) member", "error"])
        return None
    ref = None if image is None else [image.offset_data, image.size, image.name]
    return [key, sid, ref, text, regions]


def _given_id(given) -> str | None:
    return str(given) if given is not None and not isinstance(given, bool) and isinstance(given, (str, int)) \
        else None


# -- in bulk --------------------------------------------------------------------------------------

_MAGIC = np.frombuffer(b"ustar", np.uint8)
_OCTAL = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_KIND = np.zeros(256, bool)
_KIND[list(b"0\x0075")] = True  # a file (ustar, old), a contiguous file; a folder
_FILE = _KIND.copy()
_FILE[ord("5")] = False
_EXTS = (*(e.encode() for e in IMAGE_EXTS), b"txt", b"json")
_NAME = 100
_HEAD = 346  # the header fields read: name, size, type, magic and the prefix's first byte
_SPACE_STARTS = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \xc2\xe1\xe2\xe3"
"""The bytes that begin a whitespace character (``str.isspace``) in UTF-8: the ASCII ones, and the
lead bytes of U+0085 and U+00A0, of U+1680, of U+2000-U+205F, of U+3000."""
_SOLID = np.ones(256, bool)
_SOLID[np.frombuffer(_SPACE_STARTS, np.uint8)] = False
_SOLID[0x80:0xC0] = False  # continuation bytes begin no character
"""A byte of valid UTF-8 that begins a character that is not whitespace."""
_SOLID_BYTES = bytes(_SOLID)


class _Layout(NamedTuple):
    """A shard's samples as the bulk pass finds them. Per sample: its key, its span, its image,
    caption and JSON member (an index into the headers, -1 for none), its id, and whether it is
    clean (no closer look needed); per header: its name, data offset and size."""

    keys: np.ndarray
    start: np.ndarray
    end: np.ndarray
    image: np.ndarray
    text: np.ndarray
    meta: np.ndarray
    sid: list
    clean: np.ndarray
    names: np.ndarray
    data: np.ndarray
    size: np.ndarray
    members: np.ndarray  # the headers of each sample's members: members[first[g]:first[g + 1]]
    first: np.ndarray


def _bulk(buf) -> _Layout | None:
    """The shard's layout, or None when it is not the usual shard (then the walk reads it)."""
    found = _chained_headers(np.frombuffer(buf, np.uint8))
    named = None if found is None else _named(found[1])
    if named is None:
        return None
    at, _, size = found
    names, members, keys, ext, lowered = named
    new = np.r_[True, keys[1:] != keys[:-1]] if len(keys) else np.zeros(0, bool)
    first = np.flatnonzero(new)
    gid = np.cumsum(new) - 1
    largest = int(np.diff(np.r_[first, len(keys)]).max(initial=1))
    twice = any(((gid[d:] == gid[:-d]) & (lowered[d:] == lowered[:-d])).any() for d in range(1, largest))
    if twice or not _distinct(keys[first]):
        return None  # a name twice in a sample (k.jpg, k.JPG), or a sample's members apart: the walk
    count, data = len(first), (at + 1) * BLOCK
    image, text, meta = (np.full(count, -1) for _ in range(3))
    if count:
        rank = np.where(ext < len(IMAGE_EXTS), ext, len(IMAGE_EXTS))
        pick = (rank == np.minimum.reduceat(rank, first)[gid]) & (rank < len(IMAGE_EXTS))  # the first of IMAGE_EXTS
        image[gid[pick]] = members[pick]
        text[gid[ext == 4]] = members[ext == 4]
        meta[gid[ext == 5]] = members[ext == 5]
    bounds = np.r_[first, len(members)]
    last = members[bounds[1:] - 1]
    has = text >= 0
    clean = (image >= 0) | has
    clean[has] &= _solid_captions(buf, data[text[has]], size[text[has]])
    sid, ok = _ids(buf, data, size, meta)
    return _Layout(keys[first], at[members[first]] * BLOCK, data[last] + -(-size[last] // BLOCK) * BLOCK, image,
                   text, meta, sid, clean & ok, names, data, size, members, bounds)


def _distinct(keys: np.ndarray) -> bool:
    return bool((keys[1:] > keys[:-1]).all()) or len(np.unique(keys)) == len(keys)  # sorted, as shards usually are


def _chained_headers(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(block number, header's first ``_HEAD`` bytes, data size) of each member of a tar whose
    headers are all plain ustar/GNU ones (an octal size, no prefix, a file or a folder) chaining
    from the first block to the end of the archive; None for any other tar."""
    n = len(arr) // BLOCK
    blocks = arr[: n * BLOCK].reshape(n, BLOCK)
    at = np.flatnonzero(blocks[:, 257] == ord("u"))
    heads = blocks[at, :_HEAD]
    magic = heads[:, 257:262].view("S5").ravel() == b"ustar"
    if not magic.all():
        at, heads = at[magic], heads[magic]
    if len(at) == 0 or at[0] != 0:
        return None
    digits = heads[:, 124:135] - np.uint8(ord("0"))
    if (digits > 7).any() or ((heads[:, 135] != 0) & (heads[:, 135] != ord(" "))).any():
        return None  # base-256, or not 11 digits: the walk reads those as tarfile does
    size = digits @ _OCTAL
    following = at + 1 + -(-size // BLOCK)
    end = following[-1]
    if (not _KIND[heads[:, 156]].all() or heads[:, 345].any() or (following[:-1] != at[1:]).any()
            or ((at + 1) * BLOCK + size > len(arr)).any() or (end < n and blocks[end].any())
            or not _checksums_ok(blocks[at])):
        return None  # another kind of header, a header not where the sizes lead, a cut or damaged tar
    return at, heads, size


def _checksums_ok(headers: np.ndarray) -> bool:
    """Whether every header's checksum (six octal digits, as tar writers store it) matches."""
    digits = headers[:, 148:154].astype(np.int64) - ord("0")
    if (digits < 0).any() or (digits > 7).any():
        return False  # stored another way: the walk checks it
    stored = digits @ (8 ** np.arange(5, -1, -1, dtype=np.int64))
    total = headers.sum(1, dtype=np.int64) - headers[:, 148:156].sum(1, dtype=np.int64) + 8 * 32
    return bool((stored == total).all())


def _named(heads: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """Of each header, its name; of the files a sample takes: their header, key, extension code
    (an index into ``_EXTS``, 6 for another) and lowercased name. None when a name needs the walk."""
    count = len(heads)
    nul = (heads[:, :_NAME] == 0).argmax(1)
    nul[heads[:, _NAME - 1] != 0] = _NAME  # a name ends at its first NUL, or fills the field
    width = int(nul.max(initial=0)) + 6  # room for an extension's first 4 bytes and its end
    j = np.arange(width, dtype=np.int16)
    names = np.zeros((count, width), np.uint8)
    names[:, : min(width, _NAME)] = heads[:, : min(width, _NAME)] * (j[:_NAME] < nul[:, None])
    slash = names == ord("/")
    dots = names == ord(".")
    last = np.full(count, -1)
    if slash.any():
        last = np.where(slash, j, -1).max(1)
        dots &= j > last[:, None]  # in the base name
    dot = dots.argmax(1)  # the first: a file without one, or a hidden one, is no sample's
    members = np.flatnonzero(_FILE[heads[:, 156]] & dots[np.arange(count), dot] & (dot != last + 1))
    named, dot = names[members], dot[members]
    after = j > dot[:, None]
    if (after & (named >= 0x80)).any():
        return None  # a non-ASCII extension: str.lower decides
    lowered = named + np.uint8(32) * (after & (named >= ord("A")) & (named <= ord("Z")))
    keys = np.where(j < dot[:, None], named, 0).view(f"S{width}").ravel()
    ext = np.take_along_axis(lowered, dot[:, None] + 1 + np.arange(5), axis=1).view("S5").ravel()
    code = np.full(len(members), len(_EXTS))
    for k, known in enumerate(_EXTS):
        code[ext == known] = k
    return names.view(f"S{width}").ravel(), members, keys, code, lowered.view(f"S{width}").ravel()


def _solid_captions(buf, offset: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per caption: surely valid UTF-8 holding a character that is not whitespace (so neither a
    decoding error nor blank); False leaves it to the per-sample checks."""
    joined = b"".join([buf[a : a + n] for a, n in zip(offset.tolist(), size.tolist())])
    try:
        joined.decode("utf-8")
    except UnicodeDecodeError:
        return np.zeros(len(size), bool)
    filled = size > 0
    begin = (np.cumsum(size) - size)[filled]
    lead = np.frombuffer(joined, np.uint8)[begin]
    if ((lead & 0xC0) == 0x80).any():
        return np.zeros(len(size), bool)  # valid only joined: a character begun in another caption
    solid = _SOLID[lead]  # most captions begin with a character that is not whitespace
    if not solid.all():
        solid = np.maximum.reduceat(np.frombuffer(joined.translate(_SOLID_BYTES), np.uint8), begin) > 0
    out = np.zeros(len(size), bool)
    out[filled] = solid
    return out


def _ids(buf, data: np.ndarray, size: np.ndarray, meta: np.ndarray) -> tuple[list, np.ndarray]:
    """Per sample: the id its JSON member gives, and False where the per-sample checks must look
    (JSON that is not one object, an id that is not valid Unicode, regions, which they keep)."""
    has = np.flatnonzero(meta >= 0)
    sid: list = [None] * len(meta)
    ok = np.ones(len(meta), bool)
    if not len(has):
        return sid, ok
    pieces = [buf[a : a + n] for a, n in zip(data[meta[has]].tolist(), size[meta[has]].tolist())]
    values = loads_objects(SEPARATOR.join(pieces), len(pieces))
    given = [] if values is None else [_given_id(v.get("id")) for v in values]
    try:
        "".join(g for g in given if g is not None).encode("utf-8")
    except UnicodeEncodeError:
        values = None
    if values is None:
        ok[has] = False
        return sid, ok
    for g, s, v in zip(has.tolist(), given, values):
        sid[g] = s
        ok[g] = REGIONS_KEY not in v
    return sid, ok


def _layout_scan(buf, layout: _Layout, keep_samples: bool) -> ShardScan:
    """The scan from a layout: its clean samples as they are, the others through ``_sample``."""
    problems: list[list[str]] = []
    looked = {}
    for g in np.flatnonzero(~layout.clean).tolist():
        m = layout.members[layout.first[g] : layout.first[g + 1]].tolist()
        found = [_Member(layout.names[k].decode("utf-8", "surrogateescape"), int(layout.data[k]) - BLOCK,
                         int(layout.data[k]), int(layout.size[k])) for k in m]
        [(key, group)] = _groups(found).items()
        looked[g] = _sample(lambda x: buf[x.offset_data : x.offset_data + x.size], key, group, problems)
    keep = layout.clean.copy()
    has_image, has_text = layout.image >= 0, layout.text >= 0
    for g, sample in looked.items():
        keep[g] = sample is not None
        if sample is not None:
            has_image[g], has_text[g] = sample[2] is not None, sample[3] is not None
    samples = _samples(buf, layout, keep, looked) if keep_samples else None
    return ShardScan(layout.start[keep], layout.end[keep], has_image[keep], has_text[keep], samples, problems)


def _samples(buf, layout: _Layout, keep: np.ndarray, looked: dict) -> list[list]:
    out = []
    keys, images, texts = layout.keys.tolist(), layout.image.tolist(), layout.text.tolist()
    data, size = layout.data.tolist(), layout.size.tolist()
    for g in np.flatnonzero(keep).tolist():
        if g in looked:
            out.append(looked[g])
            continue
        image, text = images[g], texts[g]
        ref = None if image < 0 else [data[image], size[image], layout.names[image].decode("utf-8", "surrogateescape")]
        caption = None if text < 0 else buf[data[text] : data[text] + size[text]].decode("utf-8")
        out.append([keys[g].decode("utf-8", "surrogateescape"), layout.sid[g], ref, caption, None])
    return out
