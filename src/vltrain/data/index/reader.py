"""The compact sample index of a source, and the source that reads rows through it.

A billion-row dataset cannot be parsed into Python lists by every rank and every loader worker
at start-up. So each source is scanned once (``vltrain data index``, or automatically on first
use: ``build.py``) into a folder of numpy columns, a few bytes per sample::

    INDEX/meta.json        what was indexed (files, sizes, mtimes, tokenizer, text length, counts)
    INDEX/problems.jsonl   every malformed (dropped) or suspicious (kept) row, with file and line
    INDEX/offset.npy  uint64   manifests: byte offset of the row;  shards: of the sample's span;
                               parquet: the row in its row group
    INDEX/length.npy  uint32   bytes of the row / of the span (headers and members); parquet: the row group
    INDEX/line.npy    uint32   manifests: the row's line;          shards, parquet: the file
    INDEX/has_image.npy, has_text.npy  bool
    INDEX/tokens-TOKENIZER-LENGTH.npy  uint16  the caption's tokens (with special tokens, capped
                           at LENGTH), 0 without text: one file per tokenizer, made on first use

20 bytes per sample, memory-mapped read-only: every rank and worker on a node shares the same
pages, and opening the index costs milliseconds whatever its size. Texts, ids and images are
read when a sample is loaded: one ``pread`` of the manifest row, or of the sample's tar span.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from vltrain.data.sources.manifests import (
    IMAGE_KEYS,
    REGIONS_KEY,
    TEXT_KEYS,
    Problem,
    Row,
    Source,
    check_row,
    csv_fields,
    json_fields,
)
from vltrain.data.sources.parquet import RowGroupReader, image_ext, image_path, row_key
from vltrain.data.sources.remote import is_remote
from vltrain.data.sources.shard_cache import ShardCache
from vltrain.data.sources.shards import IMAGE_EXTS, span_members
from vltrain.data.table import default_blocks

INDEX_VERSION = 2
"""2: ``meta.json`` lists the damaged files and row groups (``damaged``)."""
COLUMNS = {"offset": np.uint64, "length": np.uint32, "line": np.uint32, "has_image": np.bool_, "has_text": np.bool_}
BYTES_PER_SAMPLE = sum(np.dtype(t).itemsize for t in COLUMNS.values()) + 2  # + the token counts
PROBLEMS_KEPT = 1000
"""Problems held in memory (the first ones); all of them are in problems.jsonl."""


def read_meta(index_dir: Path) -> dict | None:
    try:
        with open(index_dir / "meta.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_columns(index_dir: Path) -> dict[str, np.ndarray]:
    """The columns, memory-mapped read-only (an empty source has plain empty arrays)."""
    out = {}
    for name, dtype in COLUMNS.items():
        path = index_dir / f"{name}.npy"
        out[name] = np.load(path, mmap_mode="r") if path.stat().st_size > 128 else np.zeros(0, dtype)
    return out


def load_problems(index_dir: Path, limit: int = PROBLEMS_KEPT) -> list[Problem]:
    problems = []
    with open(index_dir / "problems.jsonl", encoding="utf-8") as f:
        for line in f:
            if len(problems) >= limit:
                break
            where, reason, level = json.loads(line)
            problems.append(Problem(where, reason, level))
    return problems


class IndexedSource(Source):
    """A manifest or shard source whose rows are located through its sample index.

    ``local(name)`` maps a file the index names (a manifest, a shard, or an image a manifest
    points to) to a local path: the file itself, or its copy in the shard cache for remote data.
    """

    def __init__(self, name: str, index_dir: Path, meta: dict, cache: ShardCache | None = None):
        self.name = name
        self.index_dir = index_dir
        self.meta = meta
        self.kind = meta["kind"]
        self.files: list[str] = [f["path"] for f in meta["files"]]
        self.columns = load_columns(index_dir)
        self.problems = load_problems(index_dir)
        self.error_total = int(meta["errors"])
        self.damaged = meta.get("damaged", [])
        self.cache = cache
        self.lengths = None
        """The token counts: an array, or a function making them (set by ``open_indexed``)."""
        self.lengths_file: Path | None = None
        """Where the token counts for the dataset's tokenizer are (or will be) stored."""
        self._stat = {f["path"]: {"size": f["size"], "version": f.get("version", "")} for f in meta["files"]}
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()
        self._span: tuple[int, dict[str, bytes], str] | None = None
        self._row: tuple[int, Row | tuple] | None = None  # parquet: (Row, image)
        if self.kind == "manifest" and meta.get("csv"):
            self._csv = meta["csv"]
        self._groups = RowGroupReader(meta["parquet"]) if self.kind == "parquet" else None

    def __len__(self) -> int:
        return int(self.meta["count"])

    def error_count(self) -> int:
        return self.error_total

    # -- columns --------------------------------------------------------------------------------

    def has_image(self) -> np.ndarray:
        return self.columns["has_image"]

    def has_text(self) -> np.ndarray:
        return self.columns["has_text"]

    def text_len(self) -> np.ndarray:
        """Caption token counts, made on first use (a tokenizer pass over every caption)."""
        if callable(self.lengths):
            self.lengths = self.lengths()
        if self.lengths is None:
            raise ValueError(f"{self.name}: opened without a tokenizer, so without token counts")
        return self.lengths

    def lengths_at_hand(self) -> np.ndarray | None:
        """The token counts if they exist already (no tokenizer pass), else None."""
        if callable(self.lengths) and self.lengths_file is not None and self.lengths_file.is_file():
            self.lengths = np.load(self.lengths_file, mmap_mode="r")
        return None if callable(self.lengths) else self.lengths

    def blocks(self) -> np.ndarray:
        """Starts of the rows read together (each shard's samples, each parquet row group's; runs of
        manifest rows), then n."""
        if self.kind == "parquet":
            return _group_starts(self.columns["line"], self.columns["length"])
        if self.kind == "shards":
            line = self.columns["line"]  # searched in its own dtype: no copy of the mapped column
            return np.searchsorted(line, np.arange(len(self.files) + 1, dtype=line.dtype)).astype(np.int64)
        return default_blocks(len(self))

    def texts(self) -> list[str | None]:
        """Every row's text, read row by row (for tools; training never needs them all)."""
        return [self.row(i).text for i in range(len(self))]

    # -- rows -----------------------------------------------------------------------------------

    def _read(self, file: str, offset: int, length: int) -> bytes:
        fd = self.cache.hold(file, self._stat.get(file)) if self.cache is not None else self._local_fd(file)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"{file} ends early: wanted {length} bytes at offset {offset}, got {len(data)} "
                          "(the file changed after it was indexed?)")
        return data

    def _local_fd(self, file: str) -> int:
        """A descriptor on a local file, kept open (the 64 last opened): local files are never
        deleted. A remote file's copy is held by the shard cache instead, one at a time
        (``ShardCache.hold``): an evicted copy held open would keep its disk space."""
        if os.getpid() != self._pid:  # a forked loader worker opens its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(file)
        if fd is None:
            if len(self._fds) >= 64:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def row(self, i: int) -> Row:
        c = self.columns
        offset, length, line = int(c["offset"][i]), int(c["length"][i]), int(c["line"][i])
        if self.kind == "manifest":
            if self._row is None or self._row[0] != i:  # read_image(i) follows row(i): parse once
                self._row = (i, self._manifest_row(offset, length, line))
            return self._row[1]
        if self.kind == "parquet":
            return self._parquet_row(i, offset, length, line)[0]
        return self._shard_row(i, offset, length, line)[0]

    def _manifest_row(self, offset: int, length: int, line: int) -> Row:
        file = self.files[0]
        raw = self._read(file, offset, length)
        if self.kind == "manifest" and self.meta.get("csv"):
            spec = self._csv
            values = next(csv.reader([raw.decode("utf-8", "surrogateescape")], delimiter=spec["separator"]))
            fields, why = csv_fields(values, spec["header"])
            keys = (spec["id_col"], _one(spec["image_col"]), _one(spec["text_col"]))
        else:
            fields, why = json_fields(raw)
            keys = ("id", IMAGE_KEYS, TEXT_KEYS)
        name = Path(file).name
        row, problems = (None, []) if why else check_row(fields, *keys, name, line)
        if row is None:
            raise OSError(f"{name}:{line} no longer holds the row that was indexed (the manifest changed?)")
        return Row(row[0], row[1], row[2], f"{name}:{line}", fields.get(REGIONS_KEY))

    def _shard_row(self, i: int, offset: int, length: int, shard: int) -> tuple[Row, dict[str, bytes]]:
        file = self.files[shard]
        if self._span is None or self._span[0] != i:
            key, members = span_members(self._read(file, offset, length))
            self._span = (i, members, key)
        _, members, key = self._span
        image_ext = next((e for e in IMAGE_EXTS if e in members), None)
        text = members["txt"].decode("utf-8") if "txt" in members else None
        sid = regions = None
        if "json" in members:
            meta = json.loads(members["json"].decode("utf-8"))
            meta = meta if isinstance(meta, dict) else {}
            given, regions = meta.get("id"), meta.get(REGIONS_KEY)
            if given is not None and not isinstance(given, bool) and isinstance(given, (str, int)):
                sid = str(given)
        name = Path(file).name
        image = None if image_ext is None else f"{file}:{key}.{image_ext}"
        text = text if text is not None and text.strip() else None
        return Row(sid if sid is not None else key, image, text, f"{name}:{key}", regions), members

    def _parquet_row(self, i: int, r: int, g: int, k: int) -> tuple[Row, object]:
        """Row ``i`` (row ``r`` of row group ``g`` of file ``k``) and its image: bytes, a resolved
        path, or None. Kept until another row is asked for: read_image(i) follows row(i)."""
        if self._row is not None and self._row[0] == i:
            return self._row[1]
        file = self.files[k]
        given, text, image, regions = self._groups.fields(file, g, r, self._parquet_input)
        if isinstance(image, str):
            image = image_path(file, image)
        ref = image if isinstance(image, str) else None if image is None else f"{file}:{g}:{r}.{image_ext(image)}"
        key = given if given is not None else row_key(file, g, r)
        self._row = (i, (Row(key, ref, text, f"{file.rsplit('/', 1)[-1]}:{g}:{r}", regions), image))
        return self._row[1]

    def read_image(self, i: int) -> bytes:
        c = self.columns
        offset, length, line = int(c["offset"][i]), int(c["length"][i]), int(c["line"][i])
        if self.kind == "manifest":
            row = self.row(i)
            if row.image is None:
                raise ValueError(f"row {i} of {self.name} has no image")
            return self._read_image_file(row.image)
        if self.kind == "parquet":
            image = self._parquet_row(i, offset, length, line)[1]
            if image is None:
                raise ValueError(f"row {i} of {self.name} has no image")
            return image if isinstance(image, bytes) else self._read_image_file(image)
        _, members = self._shard_row(i, offset, length, line)
        ext = next((e for e in IMAGE_EXTS if e in members), None)
        if ext is None:
            raise ValueError(f"row {i} of {self.name} has no image")
        return members[ext]

    def _parquet_input(self, file: str) -> str | BinaryIO:
        """What a parquet file is read from: its path, or the shard cache's held copy (not closed
        here: the cache closes it when this process moves to another file)."""
        if self.cache is None:
            return file
        return open(self.cache.hold(file, self._stat.get(file)), "rb", closefd=False)

    def _read_image_file(self, image: str) -> bytes:
        base = self.files[0].rsplit("/", 1)[0] if "/" in self.files[0] else "."
        path = image if os.path.isabs(image) or "://" in image else f"{base}/{image}"
        if is_remote(path):
            if self.cache is None:
                raise OSError(f"{path}: a remote image in a local manifest; give data.cache_dir")
            return self.cache.read_bytes(path)  # one GET: images of a manifest are not cached
        with open(path, "rb") as f:
            return f.read()

    def prefetch(self, rows: np.ndarray) -> None:
        """Start downloading the remote shards ``rows`` live in (nothing for local data)."""
        if self.cache is not None and self.kind in ("shards", "parquet"):
            shards = np.unique(np.asarray(self.columns["line"][np.sort(rows)]))
            self.cache.prefetch(self.files[int(k)] for k in shards)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_fds={}, _span=None, _row=None, columns=None, lengths=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.columns = load_columns(self.index_dir)
        if self.lengths_file is not None and self.lengths_file.is_file():
            self.lengths = np.load(self.lengths_file, mmap_mode="r")


def _one(column: str | None) -> tuple[str, ...]:
    return (column,) if column else ()


def _group_starts(file: np.ndarray, group: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
    """Where each (file, row group) run starts, then n: compared a chunk at a time, so a billion
    mapped rows never need a billion-byte temporary."""
    n = len(file)
    starts = [np.zeros(min(n, 1), np.int64)]
    for lo in range(1, n, chunk):
        f, g = file[lo - 1 : lo + chunk], group[lo - 1 : lo + chunk]
        starts.append(np.flatnonzero((f[1:] != f[:-1]) | (g[1:] != g[:-1])).astype(np.int64) + lo)
    return np.concatenate([*starts, [n]]).astype(np.int64)
