"""img2dataset-style tar shards with random access: ``KEY.jpg|jpeg|png|webp``, ``KEY.txt``, ``KEY.json``.

Streaming a tar is the usual way to read WebDataset shards, but then the sampler cannot choose
the order, so there is no exact resume and no shared shuffle with manifests. Instead each shard
is scanned once into an index (member offsets, plus the captions and ids, which are small) that
is cached next to the shard, or in a cache folder when the shard's folder is read-only (the scan:
``shard_scan.py``). Reading sample ``i`` is then one seek and one read.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import tarfile
from bisect import bisect_right
from pathlib import Path
from typing import Callable

import numpy as np

from vltrain.data.regions import decoded_regions, resized_regions
from vltrain.data.sources.filelock import build_once, private_tmp
from vltrain.data.sources.manifests import Problem, Row, Source
from vltrain.data.sources.patterns import expand_braces
from vltrain.data.sources.shard_scan import IMAGE_EXTS, UnusualHeader, scan_shard, walk_members
from vltrain.errors import DataError

INDEX_VERSION = 2
"""2: each sample keeps its ``.json``'s regions."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vltrain" / "shard-index"


class ShardSource(Source):
    """All samples of the shards a pattern names, in shard order then member order."""

    def __init__(self, pattern: str, cache_dir: str | os.PathLike | None = None):
        self.name = pattern
        self.paths = [Path(p) for p in shard_paths(pattern)]
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise DataError(f"{pattern}: {len(missing)} of {len(self.paths)} shard(s) not found: {shown}")
        self.problems = []
        self.damaged = []
        self._keys: list[str] = []
        self._texts: list[str | None] = []
        self._regions: list = []
        self._images: list[tuple[int, int, str] | None] = []  # (offset, size, member name)
        self._where: list[str] = []
        self._starts: list[int] = []
        for path in self.paths:
            self._starts.append(len(self._keys))
            index = load_index(path, cache_dir)
            for p in index["problems"]:
                self.problems.append(Problem(f"{path.name}:{p[0]}", p[1], p[2]))
                self.damaged += [{"where": f"{path.name}:{p[0]}", "reason": p[1], **p[3]}] if len(p) > 3 else []
            for key, sid, image, text, regions in index["samples"]:
                self._keys.append(sid if sid is not None else key)
                self._texts.append(text)
                self._regions.append(regions)
                self._images.append(tuple(image) if image is not None else None)
                self._where.append(f"{path.name}:{key}")

    def __len__(self) -> int:
        return len(self._keys)

    def _shard(self, i: int) -> Path:
        return self.paths[bisect_right(self._starts, i) - 1]

    def row(self, i: int) -> Row:
        image = self._images[i]
        ref = None if image is None else f"{self._shard(i)}:{image[2]}"
        return Row(self._keys[i], ref, self._texts[i], self._where[i], self._regions[i])

    def read_image(self, i: int) -> bytes:
        image = self._images[i]
        if image is None:
            raise ValueError(f"row {i} of {self.name} has no image")
        offset, size, _ = image
        with open(self._shard(i), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"shard ends early: wanted {size} bytes at offset {offset}, got {len(data)}")
        return data

    def texts(self) -> list[str | None]:
        return self._texts

    def has_image(self) -> np.ndarray:
        return np.fromiter((im is not None for im in self._images), dtype=bool, count=len(self))


def shard_paths(pattern: str) -> list[str]:
    """Brace ranges and lists ('{00000..00009}', '{a,b}') expanded; globs ('*.tar') sorted."""
    out = []
    for p in expand_braces(pattern):
        matches = sorted(glob.glob(p)) if glob.has_magic(p) else []
        out.extend(matches or [p])  # a pattern matching nothing stays, to be reported missing
    return out


# -- the per-shard index --------------------------------------------------------------------------


def index_path(shard: Path, cache_dir: str | os.PathLike | None) -> Path:
    """Next to the shard when that folder is writable, else in ``cache_dir``."""
    beside = shard.with_name(shard.name + ".idx.json")
    if beside.exists() or os.access(shard.parent, os.W_OK):
        return beside
    digest = hashlib.blake2b(str(shard.resolve()).encode(), digest_size=8).hexdigest()
    return Path(cache_dir or default_cache_dir()) / f"{digest}-{shard.name}.idx.json"


BUILDS = 0
"""Indexes this process built (rather than read); the index race test counts them."""


def load_index(shard: Path, cache_dir: str | os.PathLike | None = None, wait_s: float = 1800.0) -> dict:
    """The cached index of ``shard``, rebuilt when missing or when the shard changed; built by one
    process while the others wait (``vltrain.data.sources.filelock``)."""
    path = index_path(shard, cache_dir)
    st = shard.stat()

    def build() -> dict:
        global BUILDS
        index = build_index(shard)
        index.update(version=INDEX_VERSION, size=st.st_size, mtime_ns=st.st_mtime_ns)
        tmp = private_tmp(path)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, ensure_ascii=False, separators=(",", ":"))
        os.replace(tmp, path)
        BUILDS += 1
        return index

    return build_once(path, lambda: _read_fresh(path, st), build, what=f"index {shard}", wait_s=wait_s)


def _read_fresh(path: Path, st: os.stat_result) -> dict | None:
    """The index at ``path`` if it exists and describes the shard as it is now."""
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    fresh = (index.get("version"), index.get("size"), index.get("mtime_ns")) == (
        INDEX_VERSION, st.st_size, st.st_mtime_ns
    )
    return index if fresh else None


def build_index(shard: Path) -> dict:
    """Scan a tar once: ``samples`` [key, id, [offset, size, member] | None, text | None, regions]."""
    scan = scan_shard(shard, samples=True)
    return {"samples": scan.samples, "problems": scan.problems}


def span_members(buf: bytes) -> tuple[str, dict[str, bytes]]:
    """The key and the members ({extension: bytes}) of one sample's span of a tar.

    The span's 512-byte headers are read directly (name, size, type; GNU long names and pax
    paths too): opening ``tarfile`` on every sample cost 4x the rest of reading it. Any header
    this walk does not know goes to ``tarfile``."""
    try:
        members = _walk_span(buf)
    except UnusualHeader:
        members = _tarfile_span(buf)
    key = None
    out: dict[str, bytes] = {}
    for name, data in members:
        base = name.rsplit("/", 1)[-1]
        if "." not in base:
            continue
        stem, ext = base.split(".", 1)
        member_key = name[: len(name) - len(base)] + stem
        key = member_key if key is None else key
        if member_key == key:
            out[ext.lower()] = data
    if key is None:
        raise OSError("no tar member where the index says a sample starts (the shard changed?)")
    return key, out


def _walk_span(buf: bytes) -> list[tuple[str, bytes]]:
    return [(m.name, bytes(buf[m.offset_data : m.offset_data + m.size])) for m in walk_members(buf)]


def _tarfile_span(buf: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(buf), mode="r:") as tar:
        return [(info.name, tar.extractfile(info).read()) for info in tar if info.isfile()]


# -- writing shards -------------------------------------------------------------------------------


def write_shards(source: Source, out: str | os.PathLike, shard_size: int,
                 transform: Callable[[bytes, str], tuple[bytes, str]] | None = None) -> tuple[list[Path], list[Problem]]:
    """Copy every readable row of ``source`` into ``out/00000.tar, ...``; unreadable rows are skipped.

    Image bytes are copied as they are (JPEG, PNG and WebP; other formats are re-encoded as PNG),
    so sharding never changes a pixel, unless ``transform`` (``(bytes, name) -> (bytes,
    extension)``, a resize) is given. Each sample's key travels in ``KEY.json`` as ``id``, and its
    regions as ``regions`` (their boxes scaled with a resized image).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    width = max(4, len(str(shard_size - 1)))
    written: list[Path] = []
    skipped: list[Problem] = []
    tar = None
    count = 0
    for i in range(len(source)):
        row = source.row(i)
        members, regions = {}, row.regions
        if row.image is not None:
            try:
                data, name = source.read_image(i), row.image
                if transform is not None:
                    stored, (data, ext) = data, transform(data, name)
                    name = f"image.{ext}"
                    regions = regions if regions is None else resized_regions(regions, stored, data)
                members.update(_image_member(data, name))
            except (OSError, ValueError) as e:
                skipped.append(Problem(row.where, f"image {row.image} not copied: {e}"))
                continue
        if row.text is not None:
            members["txt"] = row.text.encode("utf-8")
        meta = {"id": row.key} | ({} if regions is None else {"regions": decoded_regions(regions)})
        members["json"] = json.dumps(meta, ensure_ascii=False).encode("utf-8")
        if count % shard_size == 0:
            if tar is not None:
                _close(tar, written[-1])
            written.append(out / f"{len(written):05d}.tar")
            tar = tarfile.open(written[-1].with_name(written[-1].name + ".tmp"), "w", format=tarfile.GNU_FORMAT)
        key = f"{len(written) - 1:05d}{count % shard_size:0{width}d}"
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        count += 1
    if tar is not None:
        _close(tar, written[-1])
    return written, skipped


def _image_member(data: bytes, name: str) -> dict[str, bytes]:
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    ext = "jpg" if ext == "jpeg" else ext
    if ext in IMAGE_EXTS:
        return {ext: data}
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, "PNG")
    return {"png": buf.getvalue()}


def _close(tar: tarfile.TarFile, path: Path) -> None:
    tar.close()
    os.replace(path.with_name(path.name + ".tmp"), path)
    load_index(path)  # index it now, while the shard is hot in the page cache
