"""Parquet files as a source: Hugging Face Hub datasets and img2dataset's parquet output.

The Hub serves image-text sets as ``data/train-0000K-of-0000N.parquet``, the image in a struct
``{bytes, path}`` (the ``datasets`` Image feature); img2dataset writes the image as plain binary
(column ``jpg``) with ``caption``, ``key`` and a download ``status``; a third kind holds a path
string, relative to the parquet file. All three are read with pyarrow.

A parquet file cannot be read one row at a time: the unit of reading is a column chunk of a row
group. So the sample index (``vltrain.data.index``) locates a row by (file, row group, row of
the group), the windowed shuffle takes row groups as its blocks, and :class:`RowGroupReader`
keeps the last row groups it decoded, enough for a window of them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from vltrain.data.config import CsvConfig
from vltrain.data.sources.manifests import IMAGE_KEYS, REGIONS_KEY, TEXT_KEYS
from vltrain.data.sources.patterns import expand_braces
from vltrain.errors import DataError

BINARY_IMAGE_KEYS = (*IMAGE_KEYS, "jpg", "jpeg", "png", "webp", "img")
"""Image column aliases: the manifests' ones, then img2dataset's (``jpg``, or the encode format)."""
ID_KEYS = ("id", "key")
CACHED_GROUPS = 24
"""Row groups a reader keeps decoded: more than a default window (16) of the shuffle."""
CACHED_BYTES = 512 << 20
"""... unless they hold more than this many bytes together (the oldest go first)."""


def require_pyarrow():
    """``pyarrow.parquet``, or a DataError naming the extra that installs it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError("reading .parquet files needs pyarrow: pip install 'vltrain[parquet]'") from e
    return pq


def is_parquet(spec: str) -> bool:
    """A ``.parquet`` path, a brace pattern of them, or a glob of them."""
    first = expand_braces(spec)[0] if "{" in spec else spec
    return first.lower().endswith(".parquet")


class UnreadableParquet(DataError):
    """A file pyarrow cannot open: cut short (no footer), or no parquet at all."""


def parquet_columns(path: str, cfg: CsvConfig | None = None, schema=None) -> dict:
    """Which columns of a parquet file hold the image, text and id, and how the image is stored:
    ``{"image", "image_kind": struct | binary | path, "text", "id"}`` (absent ones None). Named in
    config (``data.csv.image_key`` ...) or found by the manifests' aliases."""
    pq = require_pyarrow()
    import pyarrow as pa

    cfg = cfg or CsvConfig()
    if schema is None:
        try:
            schema = pq.read_schema(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise UnreadableParquet(f"{Path(path).name}: not a readable parquet file ({e})") from e
    names = list(schema.names)
    image = _pick(names, cfg.image_key, BINARY_IMAGE_KEYS)
    text = _pick(names, cfg.text_key, TEXT_KEYS)
    if image is None and text is None:
        raise DataError(f"{path}: columns {names} hold no image ({cfg.image_key!r} or one of {BINARY_IMAGE_KEYS}) "
                        f"and no text ({cfg.text_key!r} or one of {TEXT_KEYS}); name them with "
                        "data.csv.image_key / data.csv.text_key")
    kind = None
    if image is not None:
        t = schema.field(image).type
        if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            kind = "struct"
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            kind = "binary"
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            kind = "path"
        else:
            raise DataError(f"{path}: image column {image!r} is {t}; expected a {{bytes, path}} struct "
                            "(Hugging Face Image), binary (img2dataset) or a path string")
    if text is not None and not (pa.types.is_string(schema.field(text).type)
                                 or pa.types.is_large_string(schema.field(text).type)):
        raise DataError(f"{path}: text column {text!r} is {schema.field(text).type}, not a string")
    given = cfg.id_key if cfg.id_key in names else next((k for k in ID_KEYS if k in names), None)
    status = "status" if kind == "binary" and "status" in names else None
    spec = {"image": image, "image_kind": kind, "text": text, "id": given, "status": status}
    if REGIONS_KEY in names:  # only then: the spec keys the sample index, which a file without them keeps
        spec["regions"] = REGIONS_KEY
    return spec


def _pick(names: list[str], configured: str, aliases: tuple[str, ...]) -> str | None:
    return configured if configured in names else next((a for a in aliases if a in names), None)


# -- scanning (index build) -----------------------------------------------------------------------


def scan_parquet(local: str, spec: dict, name: str, problems: list, texts: bool):
    """Per row group: (row group, rows of the group, has_image, has_text, captions or None).

    Rows img2dataset failed to download (``status`` not ``success``, no image) are dropped and
    counted in one problem per file, as its tar output leaves them out. Only the text column is
    read when the row group's statistics say the image column has no nulls.

    A file pyarrow cannot open (a cut download: no footer) or a row group it cannot read (a
    damaged page) is skipped and recorded as an error problem, with the rows lost where known:
    the other files and row groups are kept."""
    pq = require_pyarrow()
    try:
        f = pq.ParquetFile(local)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        problems.append([name, f"damaged parquet: not readable ({e}); its rows (how many is unknown) are skipped",
                         "error", {"offset": 0, "kept": 0, "lost": 0, "exact": False}])
        return
    _check_columns(f.schema_arrow, spec, name)
    failed = kept = 0
    damaged: list = []
    for g in range(f.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        wanted = [c for c in (spec["text"], spec["status"]) if c]
        if spec["image"] and _image_nulls(f, g, spec):
            wanted.append(spec["image"])
        try:
            table = f.read_row_group(g, columns=wanted)
        except Exception as e:  # a damaged page: ArrowInvalid, OSError (bad compression, thrift)
            damaged.append([f"{name}:row group {g}", f"damaged parquet: row group {g} unreadable ({e})", "error",
                            {"offset": g, "kept": 0, "lost": n, "exact": True}])
            continue
        caps = table.column(spec["text"]).to_pylist() if spec["text"] else [None] * n
        has_text = np.fromiter((isinstance(c, str) and bool(c.strip()) for c in caps), bool, n)
        has_image = _has_image(table, spec, n)
        keep = np.ones(n, bool)
        if spec["status"]:
            status = np.asarray(table.column(spec["status"]).to_pylist(), object)
            keep = has_image | (status == "success")
            failed += int((~keep).sum())
        keep &= has_image | has_text
        rows = np.flatnonzero(keep)
        kept += len(rows)
        yield g, rows, has_image[rows], has_text[rows], [caps[r] for r in rows] if texts else None
    for where, why, level, lost in damaged:
        lost["kept"] = kept
        problems.append([where, f"{why}; {kept} rows of the file kept, {lost['lost']} lost", level, lost])
    if failed:
        problems.append([name, f"{failed} row(s) without an image skipped: img2dataset status is not "
                               "'success'", "warning"])


def _check_columns(schema, spec: dict, name: str) -> None:
    missing = [c for c in (spec["image"], spec["text"], spec["id"], spec.get("regions")) if c and c not in schema.names]
    if missing:
        raise DataError(f"{name}: no column {missing} (its columns: {schema.names}); every file of a "
                        "parquet source needs the columns of the first")


def _image_nulls(f, g: int, spec: dict) -> bool:
    """Whether the image column of row group ``g`` may hold nulls (True when unknown)."""
    md = f.metadata.row_group(g)
    leaves = {f"{spec['image']}.bytes", spec["image"]} if spec["image_kind"] == "struct" else {spec["image"]}
    for j in range(md.num_columns):
        col = md.column(j)
        if col.path_in_schema in leaves:
            stats = col.statistics
            return stats is None or not stats.has_null_count or stats.null_count > 0
    return True


def _has_image(table, spec: dict, n: int) -> np.ndarray:
    if not spec["image"]:
        return np.zeros(n, bool)
    if spec["image"] not in table.column_names:
        return np.ones(n, bool)  # the statistics say: no nulls
    column = table.column(spec["image"]).combine_chunks()
    if spec["image_kind"] == "struct":
        data = column.field("bytes")
        path = column.field("path")
        valid = np.asarray(data.is_valid()) | np.asarray(path.is_valid())
        return valid & np.asarray(column.is_valid())
    return np.asarray(column.is_valid())


# -- reading rows ---------------------------------------------------------------------------------


class RowGroupReader:
    """Rows of parquet files by (file, row group, row), the decoded row groups kept (LRU)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self._files: dict[str, object] = {}
        self._groups: OrderedDict[tuple[str, int], dict] = OrderedDict()
        self._bytes = 0
        self._pid = os.getpid()

    def group(self, file: str, g: int, local) -> dict:
        """Row group ``g`` of ``file`` as {column: array}, read (the wanted columns) on first use
        from ``local(file)``: the file's path, kept open (the 64 last used), or for a remote file
        the copy the shard cache holds open for this process (``ShardCache.hold``), read from
        and let go, since an evicted copy held open would keep its disk space."""
        if os.getpid() != self._pid:  # a forked loader worker reads on its own
            self._files, self._groups, self._bytes, self._pid = {}, OrderedDict(), 0, os.getpid()
        key = (file, g)
        found = self._groups.get(key)
        if found is not None:
            self._groups.move_to_end(key)
            return found
        f = self._files.get(file)
        if f is None:
            where = local(file)
            f = require_pyarrow().ParquetFile(where)
            if isinstance(where, str):
                if len(self._files) >= 64:
                    self._files.pop(next(iter(self._files)))
                self._files[file] = f
        columns = [c for c in (self.spec["image"], self.spec["text"], self.spec["id"], self.spec.get("regions")) if c]
        try:
            table = f.read_row_group(g, columns=columns)
        except OSError:
            raise
        except Exception as e:  # ArrowInvalid and the like: a bad sample to the loader, as OSError is
            raise OSError(f"{file.rsplit('/', 1)[-1]}: row group {g} unreadable ({e})") from e
        found = {"columns": {c: table.column(c) for c in columns}, "nbytes": table.nbytes}
        self._groups[key] = found
        self._bytes += table.nbytes
        while len(self._groups) > CACHED_GROUPS or (self._bytes > CACHED_BYTES and len(self._groups) > 1):
            _, old = self._groups.popitem(last=False)
            self._bytes -= old["nbytes"]
        return found

    def fields(self, file: str, g: int, r: int, local) -> tuple[str | None, str | None, object, object]:
        """(id, text, image, regions) of a row; image: bytes, a path string, or None; regions as stored
        (a list of {box, text}, JSON text, or None)."""
        cols = self.group(file, g, local)["columns"]
        spec = self.spec
        given = cols[spec["id"]][r].as_py() if spec["id"] else None
        text = cols[spec["text"]][r].as_py() if spec["text"] else None
        image = cols[spec["image"]][r].as_py() if spec["image"] else None
        regions = cols[spec["regions"]][r].as_py() if spec.get("regions") else None
        if isinstance(image, dict):  # {bytes, path}: the bytes, else the path
            image = image.get("bytes") or image.get("path")
        text = text if isinstance(text, str) and text.strip() else None
        return (None if given is None or isinstance(given, bool) else str(given)), text, image, regions

    def __getstate__(self) -> dict:
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])


def image_path(file: str, image: str) -> str:
    """A path string of an image column, resolved against the parquet file's folder."""
    if os.path.isabs(image) or "://" in image:
        return image
    if "://" in file:
        return f"{file.rsplit('/', 1)[0]}/{image}"
    return os.path.abspath(os.path.join(os.path.dirname(file), image))


def image_ext(data: bytes) -> str:
    """The usual file extension of encoded image bytes, from their magic number ("img" if unknown)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "img"


def row_key(file: str, g: int, r: int) -> str:
    """The key of a row without an id: file stem, row group, row."""
    name = file.rsplit("/", 1)[-1]
    return f"{name[: -len('.parquet')] if name.lower().endswith('.parquet') else name}:{g}:{r}"
