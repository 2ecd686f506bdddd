"""Where samples come from: JSONL and CSV/TSV manifests (tar shards: ``shards.py``; a path to
either: ``open.py``).

A source is opened once: every row is parsed up front, so that its length, keys, texts and
modalities are known without touching an image, and row ``i`` is the same row on every rank
and in every worker. Malformed rows are dropped from the index space and kept in
``source.problems`` with file and line, for ``vltrain data validate`` and for a strict
(``on_error: fail``) run to refuse them.
"""

from __future__ import annotations

import csv
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from vltrain.data.config import CsvConfig
from vltrain.data.ids import derived_key
from vltrain.errors import DataError

IMAGE_KEYS = ("image", "image_path", "filepath")
TEXT_KEYS = ("text", "caption", "title")
REGIONS_KEY = "regions"
"""The field (JSONL key, CSV column, parquet column, shard ``.json`` key) holding a row's regions."""
MANIFEST_SUFFIXES = (".jsonl", ".csv", ".tsv")


@dataclass(frozen=True)
class Row:
    """One sample as its source describes it, before anything is read or decoded."""

    key: str  # the given id, or one derived from source, position and content
    image: str | None  # where the image is: a file path, or "SHARD.tar:MEMBER"
    text: str | None
    where: str  # "train.jsonl:12" or "00003.tar:000000012", for messages
    regions: object = None
    """The row's ``regions`` as given (a list, or JSON text), checked when its image is decoded
    (:mod:`vltrain.data.regions`); None: it has none."""


@dataclass(frozen=True)
class Problem:
    """A row that is malformed ("error": dropped) or suspicious ("warning": kept)."""

    where: str
    reason: str
    level: str = "error"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class Source(ABC):
    """A sized, randomly addressable list of rows whose images can be read as bytes."""

    name: str
    problems: list[Problem]
    damaged: list[dict] = []
    """The damaged files and row groups (a cut tar, an unreadable row group), what they still gave
    and what was lost: {where, reason, offset, kept, lost, exact}. Their samples lost count
    against ``data.max_bad_fraction``; with ``data.on_error: fail`` they refuse the source."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def row(self, i: int) -> Row: ...

    @abstractmethod
    def read_image(self, i: int) -> bytes:
        """The encoded image of row ``i``; raises ``OSError`` when it cannot be read."""

    @abstractmethod
    def texts(self) -> list[str | None]:
        """Every row's text, in order (for bulk tokenization)."""

    @abstractmethod
    def has_image(self) -> np.ndarray:
        """bool [len(self)]."""

    def rows(self) -> Iterator[Row]:
        return (self.row(i) for i in range(len(self)))

    def errors(self) -> list[Problem]:
        """The malformed rows held in memory (a large indexed source holds the first ones)."""
        return [p for p in self.problems if p.level == "error"]

    def error_count(self) -> int:
        """Malformed rows in all."""
        return len(self.errors())


class ManifestSource(Source):
    """A JSONL or CSV/TSV manifest; relative image paths resolve against the manifest's folder."""

    def __init__(self, path: str | os.PathLike, csv_cfg: CsvConfig | None = None):
        self.path = Path(path)
        self.name = str(path)
        self.base = self.path.parent
        self.problems = []
        self._keys: list[str] = []
        self._images: list[str | None] = []
        self._texts: list[str | None] = []
        self._regions: list = []
        self._lines: list[int] = []
        if not self.path.is_file():
            raise DataError(f"manifest not found: {self.path}")
        if self.path.suffix.lower() == ".jsonl":
            self._read_jsonl()
        else:
            self._read_csv(csv_cfg or CsvConfig())

    def __len__(self) -> int:
        return len(self._keys)

    def row(self, i: int) -> Row:
        return Row(self._keys[i], self._images[i], self._texts[i], f"{self.path.name}:{self._lines[i]}",
                   self._regions[i])

    def read_image(self, i: int) -> bytes:
        image = self._images[i]
        if image is None:
            raise ValueError(f"row {i} of {self.name} has no image")
        with open(self.base / image, "rb") as f:
            return f.read()

    def texts(self) -> list[str | None]:
        return self._texts

    def has_image(self) -> np.ndarray:
        return np.fromiter((im is not None for im in self._images), dtype=bool, count=len(self))

    # -- parsing -------------------------------------------------------------------------------

    def _add(self, line: int, fields: dict, id_key: str, image_keys, text_keys) -> None:
        """Check one row's fields and append it, or record why it is malformed."""
        row, problems = check_row(fields, id_key, image_keys, text_keys, self.path.name, line)
        self.problems.extend(problems)
        if row is not None:
            self._keys.append(row[0])
            self._images.append(row[1])
            self._texts.append(row[2])
            self._regions.append(fields.get(REGIONS_KEY))
            self._lines.append(line)

    def _problem(self, where: str, reason: str) -> None:
        self.problems.append(Problem(where, reason))

    def _read_jsonl(self) -> None:
        with open(self.path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                fields, why = json_fields(raw)
                if why:
                    self._problem(f"{self.path.name}:{line}", why)
                    continue
                self._add(line, fields, "id", IMAGE_KEYS, TEXT_KEYS)

    def _read_csv(self, cfg: CsvConfig) -> None:
        sep = csv_separator(self.path, cfg)
        # surrogateescape keeps undecodable bytes visible, so a bad line is reported, not fatal.
        with open(self.path, newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.reader(f, delimiter=sep)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{self.path}: empty file (a header row is needed)")
            image_col, text_col, id_col = csv_columns(header, cfg, self.path)
            start = reader.line_num + 1
            for values in reader:
                line, start = start, reader.line_num + 1
                if not values:
                    continue
                fields, why = csv_fields(values, header)
                if why:
                    self._problem(f"{self.path.name}:{line}", why)
                    continue
                self._add(line, fields, id_col, (image_col,) if image_col else (), (text_col,) if text_col else ())


def check_row(fields: dict, id_key: str, image_keys, text_keys, file_name: str,
              line: int) -> tuple[tuple[str, str | None, str | None] | None, list[Problem]]:
    """A manifest row's (key, image, text), or None when it is malformed; and its problems.

    The one definition of a usable row, shared by the parsing source and the sample index."""
    where = f"{file_name}:{line}"
    image, why = _pick_string(fields, image_keys, "image")
    if not why:
        text, why = _pick_string(fields, text_keys, "text")
    if why:
        return None, [Problem(where, why)]
    blank_image = image is not None and not image.strip()
    blank_text = text is not None and not text.strip()
    image = None if blank_image else image
    text = None if blank_text else text
    if image is None and text is None:
        return None, [Problem(where, f"no image ({'|'.join(image_keys)}) and no text ({'|'.join(text_keys)})")]
    problems = []
    if blank_image:
        problems.append(Problem(where, "empty image path (row used as text-only)", "warning"))
    if blank_text:
        problems.append(Problem(where, "empty text (row used as image-only)", "warning"))
    given = fields.get(id_key)
    if given is None or given == "":
        key = derived_key(file_name, line, image, text)
    elif isinstance(given, (str, int)) and not isinstance(given, bool):
        key = str(given)
        if not is_unicode(key):
            return None, problems + [Problem(where, "id is not valid UTF-8")]
    else:
        return None, problems + [Problem(where, f"'{id_key}' must be a string or an integer, got {type(given).__name__}")]
    return (key, image, text), problems


def json_fields(raw: bytes) -> tuple[dict | None, str | None]:
    """One JSONL line's object, or why it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start} of the line)"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg}, column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})"
    return obj, None


def csv_fields(values: list[str], header: list[str]) -> tuple[dict | None, str | None]:
    """One CSV record as {column: value or None}, or why it is malformed."""
    if len(values) != len(header):
        return None, f"{len(values)} fields, the header has {len(header)}"
    if not all(is_unicode(v) for v in values):
        return None, "not valid UTF-8"
    return {k: (v if v != "" else None) for k, v in zip(header, values)}, None


def _pick_string(fields: dict, keys, what: str) -> tuple[str | None, str | None]:
    """The first present alias of ``keys``, and why it is unusable (or None)."""
    for k in keys:
        v = fields.get(k)
        if v is None:
            continue
        if not isinstance(v, str):
            return None, f"'{k}' must be a string, got {type(v).__name__}"
        if not is_unicode(v):
            return None, f"{what} is not valid UTF-8 / Unicode"
        return v, None
    return None, None


def csv_separator(path: Path, cfg: CsvConfig) -> str:
    return cfg.separator or ("\t" if path.suffix.lower() == ".tsv" else ",")


def csv_columns(header: list[str], cfg: CsvConfig, path) -> tuple[str | None, str | None, str]:
    """The image, text and id columns of a CSV header ("" for no id column)."""
    image_col = _column(header, cfg.image_key, IMAGE_KEYS)
    text_col = _column(header, cfg.text_key, TEXT_KEYS)
    if image_col is None and text_col is None:
        raise DataError(
            f"{path}: header {header} has no image column ({cfg.image_key!r} or one of "
            f"{IMAGE_KEYS}) and no text column ({cfg.text_key!r} or one of {TEXT_KEYS}); "
            "set data.csv.image_key / data.csv.text_key / data.csv.separator"
        )
    return image_col, text_col, cfg.id_key if cfg.id_key in header else ""


def _column(header: list[str], configured: str, aliases: tuple[str, ...]) -> str | None:
    if configured in header:
        return configured
    return next((a for a in aliases if a in header), None)


def is_unicode(s: str) -> bool:
    """False for strings holding lone surrogates (undecodable bytes, or bad JSON escapes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def open_manifest(path: str | os.PathLike, csv_cfg: CsvConfig | None = None) -> ManifestSource:
    """A manifest (.jsonl/.csv/.tsv); any other suffix is refused, naming the formats vltrain reads."""
    if Path(path).suffix.lower() not in MANIFEST_SUFFIXES:
        raise DataError(
            f"{path}: not a manifest (.jsonl, .csv, .tsv) or a tar shard pattern ('dir/{{00000..00009}}.tar')"
        )
    return ManifestSource(path, csv_cfg)


def refuse_malformed(source: Source, limit: int = 5) -> None:
    """Raise if ``source`` dropped malformed rows: a strict run trains on every row or none."""
    if source.damaged:
        shown = "\n  ".join(f"{d['where']}: {d['reason']}" for d in source.damaged[:limit])
        more = f"\n  ... and {len(source.damaged) - limit} more" if len(source.damaged) > limit else ""
        raise DataError(
            f"{source.name}: {len(source.damaged)} damaged file(s) or row group(s):\n  {shown}{more}\n"
            "Repair or download them again, or set data.on_error: skip to train on what they still hold "
            "(the samples lost count against data.max_bad_fraction)."
        )
    errors, total = source.errors(), source.error_count()
    if total:
        shown = "\n  ".join(str(p) for p in errors[:limit])
        more = f"\n  ... and {total - limit} more" if total > limit else ""
        raise DataError(
            f"{source.name}: {total} malformed row(s):\n  {shown}{more}\n"
            f"Fix them (see `vltrain data validate {source.name}`), or set data.on_error: skip "
            "to train without them."
        )
