"""Building a source's sample index (``reader.py``): once, in parallel, resumable.

The work is cut into parts: byte ranges of a JSONL manifest (a row belongs to the part its first
byte falls in), groups of tar shards, or a CSV manifest whole (a quoted field may hold a line
break, so a CSV cannot be split blindly). Each part is parsed by one process and written to
``INDEX.parts/`` as soon as it is done, so an interrupted build (a killed job, a preempted node)
resumes with the parts still missing. The parts are then merged into the index folder, which
appears under its final name in one rename.

The index is keyed by the files it describes (path, size, modification time or ETag) and the CSV
settings: change a file and another index is built; a stale one is never read. Caption token
counts, which depend on a tokenizer, are a column of their own (``lengths.py``).
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from multiprocessing import get_context
from pathlib import Path
from typing import NamedTuple

import numpy as np

from vltrain.data.config import CsvConfig
from vltrain.data.index.reader import COLUMNS
from vltrain.data.sources.filelock import private_tmp
from vltrain.data.sources.json_bulk import SEPARATOR, loads_objects
from vltrain.data.sources.manifests import (
    IMAGE_KEYS,
    MANIFEST_SUFFIXES,
    TEXT_KEYS,
    check_row,
    csv_columns,
    csv_fields,
    csv_separator,
    json_fields,
)
from vltrain.data.sources.parquet import is_parquet, scan_parquet
from vltrain.data.sources.patterns import is_shard_pattern
from vltrain.data.sources.remote import expand_remote, is_remote, stat_many, stat_remote
from vltrain.data.sources.shard_cache import ShardCache
from vltrain.data.sources.shard_scan import scan_shard
from vltrain.data.sources.shards import default_cache_dir, shard_paths
from vltrain.errors import DataError

PART_BYTES = 64 << 20
"""A JSONL manifest is parsed in parts of about this many bytes."""
SHARDS_PER_PART = 8
MIN_PARALLEL_BYTES = 256 << 20
"""Smaller sources are indexed in this process: starting build processes costs seconds."""


def _describe(files: list[str]) -> list[dict]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append({"path": f, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def source_files(spec: str, storage_options: dict | None = None) -> tuple[str, list[dict]]:
    """("manifest" | "shards" | "parquet", the files of a source path with their size and
    version), every one present."""
    many = "shards" if is_shard_pattern(spec) else "parquet" if is_parquet(spec) else None
    if is_remote(spec):
        if many:
            urls = expand_remote(spec, storage_options)
            return many, [{"path": u, **st} for u, st in zip(urls, stat_many(urls, storage_options))]
        if Path(spec).suffix.lower() not in MANIFEST_SUFFIXES:
            raise DataError(f"{spec}: not a manifest (.jsonl, .csv, .tsv), a tar shard pattern or .parquet")
        return "manifest", [{"path": spec, **stat_remote(spec, storage_options)}]
    if many:
        files = shard_paths(spec)
        missing = [p for p in files if not os.path.isfile(p)]
        unmatched = [p for p in missing if glob.has_magic(p)]
        if unmatched:
            more = f" (nor does {len(unmatched) - 1} more pattern(s) of it)" if len(unmatched) > 1 else ""
            raise DataError(f"{spec}: no file matches {unmatched[0]}{more}")
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            what = "shard(s)" if many == "shards" else "file(s)"
            raise DataError(f"{spec}: {len(missing)} of {len(files)} {what} not found: {shown}")
        return many, _describe(files)
    if Path(spec).suffix.lower() not in MANIFEST_SUFFIXES:
        raise DataError(f"{spec}: not a manifest (.jsonl, .csv, .tsv), a tar shard pattern ('dir/{{00000..00009}}.tar') "
                        "or .parquet")
    if not os.path.isfile(spec):
        raise DataError(f"manifest not found: {spec}")
    return "manifest", _describe([spec])


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir().parent


def index_dir_for(spec: str, files: list[str], key: str, cache_dir: str | os.PathLike | None) -> Path:
    """``.vltrain-index/NAME-KEY`` beside the data when that folder is writable, else in the cache
    (always, for remote data)."""
    name = spec.rstrip("/").rsplit("/", 1)[-1].replace("{", "").replace("}", "").replace("*", "x")[:80]
    if is_remote(spec):
        digest = hashlib.blake2b(spec.encode(), digest_size=6).hexdigest()
        return cache_root(cache_dir) / "index" / f"{digest}-{name}-{key}"
    folder = Path(files[0]).parent if files else Path(spec).parent
    beside = folder / ".vltrain-index" / f"{name}-{key}"
    if beside.exists() or os.access(folder, os.W_OK):
        return beside
    digest = hashlib.blake2b(str(folder.resolve()).encode(), digest_size=6).hexdigest()
    return cache_root(cache_dir) / "index" / f"{digest}-{name}-{key}"


def csv_spec(path: str, cfg: CsvConfig) -> dict:
    sep = csv_separator(Path(path), cfg)
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        header = next(csv.reader(f, delimiter=sep), None)
    if header is None:
        raise DataError(f"{path}: empty file (a header row is needed)")
    image_col, text_col, id_col = csv_columns(header, cfg, path)
    return {"separator": sep, "header": header, "image_col": image_col, "text_col": text_col, "id_col": id_col}


# -- parts ----------------------------------------------------------------------------------------


def plan_parts(identity: dict, cache: ShardCache | None, manifest_local: str) -> list[dict]:
    """The parts of a build; shards are read through the cache (downloaded) when remote."""
    if identity["kind"] in ("shards", "parquet"):
        files = identity["files"]
        return [{"kind": identity["kind"], "files": files, "first": i, "count": min(SHARDS_PER_PART, len(files) - i),
                 "cache": cache, "columns": identity.get("parquet")} for i in range(0, len(files), SHARDS_PER_PART)]
    size = os.path.getsize(manifest_local)
    if identity["csv"] is not None:
        return [{"kind": "csv", "file": manifest_local, "lo": 0, "hi": size, "csv": identity["csv"]}]
    return [{"kind": "jsonl", "file": manifest_local, "lo": lo, "hi": min(size, lo + PART_BYTES)}
            for lo in range(0, max(size, 1), PART_BYTES)]


class RowColumns(NamedTuple):
    """Usable rows of a part, in index order, as columns."""

    line: np.ndarray  # manifests: the row's line (from 1, in its part); shards, parquet: the file
    offset: np.ndarray  # byte offset of the row / of the sample's span; parquet: row of the row group
    length: np.ndarray  # bytes of the row / of the span; parquet: the row group
    has_image: np.ndarray
    has_text: np.ndarray
    text: list | None  # the captions (None for shards, unless asked for)


JSON_CHUNK = 4096
"""JSONL lines parsed by one json.loads call."""
_ID_TYPES = {type(None), str, int}


def _jsonl_rows(part: dict, problems: list):
    """The RowColumns of the lines starting in [lo, hi), a chunk at a time."""
    with open(part["file"], "rb") as f:
        pos = part["lo"]
        if pos > 0:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the first line that starts at or after lo
        data = f.read(max(0, part["hi"] - pos)) if pos < part["hi"] else b""
        if data and not data.endswith(b"\n"):
            data += f.readline()  # the last line starts before hi: it is this part's
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1  # line breaks included
    if data and not data.endswith(b"\n"):
        ends = np.r_[ends, len(data)]  # a last line without its line break
    starts = np.r_[0, ends][:-1]
    part["lines"] = len(ends)
    name = Path(part["file"]).name
    for first in range(0, len(ends), JSON_CHUNK):
        span = slice(first, min(len(ends), first + JSON_CHUNK))
        chunk = data[starts[span][0] : ends[span][-1]]
        lines, offsets, lengths = np.arange(span.start, span.stop) + 1, starts[span] + pos, ends[span] - starts[span]
        joined = chunk.replace(b"\n", SEPARATOR)
        values = loads_objects(joined[:-1] if chunk.endswith(b"\n") else joined, len(lines))
        rows = None if values is None else _plain_rows(values, chunk, lines, offsets, lengths)
        yield rows if rows is not None else _checked_rows(_chunk_lines(chunk, values, lines, offsets, lengths),
                                                          ("id", IMAGE_KEYS, TEXT_KEYS), name, problems)


def _plain_rows(values: list[dict], chunk: bytes, lines: np.ndarray, offsets: np.ndarray,
                lengths: np.ndarray) -> RowColumns | None:
    """The RowColumns of a chunk of lines when all are the usual row: ``text`` a non-blank string,
    ``image`` a non-blank string or absent (with no other image key), ``id`` absent, a string or
    an integer. That is what ``check_row`` passes without a word; None for any other chunk (its
    rows are then checked one by one)."""
    count = len(lines)
    texts = list(map(dict.get, values, repeat("text")))
    images = list(map(dict.get, values, repeat("image")))
    ids = list(map(dict.get, values, repeat("id")))
    if set(map(type, texts)) != {str} or not set(map(type, ids)) <= _ID_TYPES or not all(map(str.strip, texts)):
        return None
    kinds = set(map(type, images))
    if kinds == {str}:
        has_image, given = np.ones(count, bool), images
    elif kinds <= {str, type(None)}:
        has_image = np.fromiter((i is not None for i in images), bool, count)
        given = [i for i in images if i is not None]
        if any(k in v for v, i in zip(values, images) if i is None for k in IMAGE_KEYS):
            return None
    else:
        return None
    if not all(map(str.strip, given)):
        return None
    if b"\\" in chunk and b"\\u" in chunk:  # an escape may make a lone surrogate: check_row would refuse it
        try:
            "".join([*texts, *given, *(i for i in ids if type(i) is str)]).encode("utf-8")
        except UnicodeEncodeError:
            return None
    return RowColumns(lines, offsets, lengths, has_image, np.ones(count, bool), texts)


def _chunk_lines(chunk: bytes, values: list[dict] | None, lines: np.ndarray, offsets: np.ndarray,
                 lengths: np.ndarray):
    """(line, byte offset, bytes, fields or None, why) of each line of a chunk, ``values`` its
    lines' objects when they parsed together; else the lines are parsed together again without
    the blank ones, or one by one. ``why`` is True for an object whose strings are surely valid
    Unicode, False for one to check, or what is wrong with the line."""
    raws = chunk.split(b"\n")[: len(lines)]
    if values is None:
        filled = [k for k, raw in enumerate(raws) if raw.strip()]
        # without a blank line to leave out, the join is the chunk's again, which did not parse
        found = loads_objects(SEPARATOR.join([raws[k] for k in filled]), len(filled)) if len(filled) < len(raws) \
            else None
        values = [None] * len(raws)
        for k, fields in zip(filled, found or ()):
            values[k] = fields
    for raw, fields, line, offset, length in zip(raws, values, lines.tolist(), offsets.tolist(), lengths.tolist()):
        if raw.strip():
            fields, why = (fields, None) if fields is not None else json_fields(raw)
            # a line without a \\u escape holds no lone surrogate to look for
            yield line, offset, length, fields, why or b"\\u" not in raw


def _fast_row(fields: dict) -> tuple[bool, str | None] | None:
    """(has image, text) of the usual row, image and text under their first names, both given
    (or the image absent), an id absent, a string or an integer; None: ask ``check_row``."""
    image, text, given = fields.get("image"), fields.get("text"), fields.get("id")
    if type(text) is not str or not text.strip() or not (given is None or type(given) in (str, int)):
        return None
    if type(image) is str and image.strip():
        return True, text
    if image is None and not any(k in fields for k in IMAGE_KEYS):
        return False, text
    return None


def _csv_rows(part: dict):
    """The same for a CSV/TSV manifest: a record ends at a line break outside quotes."""
    spec = part["csv"]
    with open(part["file"], "rb") as f:
        pos, line, first, buf, start = 0, 0, None, b"", 0
        for raw in f:
            line += 1
            if not buf:
                start, first = pos, line
            buf += raw
            pos += len(raw)
            if buf.count(b'"') % 2:
                continue  # a quoted field goes on past this line break
            record, buf = buf, b""
            if first == 1 or not record.strip():
                continue  # the header
            values = next(csv.reader([record.decode("utf-8", "surrogateescape")], delimiter=spec["separator"]), [])
            fields, why = csv_fields(values, spec["header"])
            yield first, start, len(record), fields, why
        part["lines"] = line


def part_chunks(part: dict, problems: list, texts: bool = False):
    """The RowColumns of a part (manifests: all with their captions; shards: with them if ``texts``),
    in index order; malformed and suspicious rows go to ``problems`` as [line or where, why, level]."""
    if part["kind"] == "shards":
        yield from _shard_rows(part, problems, texts)
    elif part["kind"] == "parquet":
        yield from _parquet_rows(part, problems, texts)
    elif part["kind"] == "csv":
        spec = part["csv"]
        keys = (spec["id_col"], _cols(spec["image_col"]), _cols(spec["text_col"]))
        yield _checked_rows(_csv_rows(part), keys, Path(part["file"]).name, problems)
    else:
        yield from _jsonl_rows(part, problems)


def part_rows(part: dict, problems: list):
    """(line or shard, byte offset, bytes, has image, text) of every usable row of a part."""
    for rows in part_chunks(part, problems, texts=True):
        yield from zip(rows.line.tolist(), rows.offset.tolist(), rows.length.tolist(), rows.has_image.tolist(),
                       rows.text)


def _checked_rows(rows, keys: tuple, name: str, problems: list) -> RowColumns:
    """The RowColumns of (line, offset, bytes, fields, why) rows checked one by one: ``why`` True for
    JSONL fields known to be valid Unicode, else what is wrong with the row (or None)."""
    out = []
    for line, start, length, fields, why in rows:
        if why is True:
            fast = _fast_row(fields)
            if fast is not None:
                out.append((line, start, length, fast[0], fast[1]))
                continue
        why = why if isinstance(why, str) else None
        row, found = (None, []) if why else check_row(fields, *keys, name, line)
        problems += [[line, why, "error"]] if why else [[line, p.reason, p.level] for p in found]
        if row is not None:
            out.append((line, start, length, row[1] is not None, row[2]))
    line, start, length, image, text = (list(c) for c in zip(*out)) if out else ([], [], [], [], [])
    return RowColumns(np.array(line, np.int64), np.array(start, np.int64), np.array(length, np.int64),
                np.array(image, bool), np.array([t is not None for t in text], bool), text)


def _cols(column: str | None) -> tuple[str, ...]:
    return (column,) if column else ()


def _shard_rows(part: dict, problems: list, texts: bool):
    cache = part["cache"]
    for s in range(part["first"], part["first"] + part["count"]):
        described = part["files"][s]
        path = described["path"]
        scan = scan_shard(cache.local(path, described) if cache is not None else Path(path), samples=texts)
        problems += [[f"{path.rsplit('/', 1)[-1]}:{key}", *rest] for key, *rest in scan.problems]
        yield RowColumns(np.full(len(scan.start), s), scan.start, scan.end - scan.start, scan.has_image, scan.has_text,
                   [x[3] for x in scan.samples] if texts else None)


def _parquet_rows(part: dict, problems: list, texts: bool):
    cache = part["cache"]
    for s in range(part["first"], part["first"] + part["count"]):
        described = part["files"][s]
        path = described["path"]
        local = str(cache.local(path, described)) if cache is not None else path
        for g, rows, has_image, has_text, caps in scan_parquet(local, part["columns"], path.rsplit("/", 1)[-1],
                                                               problems, texts):
            yield RowColumns(np.full(len(rows), s), rows, np.full(len(rows), g), has_image, has_text, caps)


def _write_part(parts_dir: Path, k: int, part: dict) -> None:
    """Parse part ``k`` and write it (atomically) to ``parts_dir``; skipped when already there."""
    done = parts_dir / f"part-{k:06d}.json"
    if done.is_file():
        return
    problems: list = []
    chunks = list(part_chunks(part, problems))
    arrays = {name: np.concatenate([getattr(c, name) for c in chunks]).astype(dtype) if chunks
              else np.zeros(0, dtype) for name, dtype in COLUMNS.items()}
    tmp = private_tmp(parts_dir / f"part-{k:06d}.npz")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, parts_dir / f"part-{k:06d}.npz")
    tmp = private_tmp(done)
    tmp.write_text(json.dumps({"count": len(arrays["offset"]), "problems": problems, "lines": part.get("lines", 0)},
                              ensure_ascii=False))
    os.replace(tmp, done)


def run_parts(parts_dir: Path, parts: list[dict], work, args: tuple, workers: int, suffix: str,
              extra: list | None = None) -> None:
    """``work(parts_dir, k, parts[k], *args[, extra[k]])`` for each part not yet done
    (``part-K{suffix}`` missing), in ``workers`` processes; ``work`` and its arguments must pickle."""
    todo = [k for k in range(len(parts)) if not (parts_dir / f"part-{k:06d}{suffix}").is_file()]
    call = [(parts_dir, k, parts[k], *args, *((extra[k],) if extra is not None else ())) for k in todo]
    if workers > 1 and len(todo) > 1:
        ctx = get_context("spawn")  # not fork: the parent may hold threads (tokenizers, torch)
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx) as pool:
            for f in [pool.submit(work, *a) for a in call]:
                f.result()
    else:
        for a in call:
            work(*a)


def save_part(parts_dir: Path, k: int, array: np.ndarray) -> None:
    """Part ``k`` of a per-row column, written atomically as ``part-K.npy`` (what ``run_parts`` looks for)."""
    tmp = private_tmp(parts_dir / f"part-{k:06d}.npy")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, parts_dir / f"part-{k:06d}.npy")


def merge_parts(parts_dir: Path, bounds: list[tuple[int, int]], path: Path, dtype, shape: tuple[int, ...]
                ) -> np.ndarray:
    """The column at ``path`` (``shape``, rows ``bounds[k]`` from part k of ``parts_dir``), written
    atomically; the parts are then removed. Returns it memory-mapped."""
    out = np.lib.format.open_memmap(private_tmp(path), mode="w+", dtype=dtype, shape=shape)
    for k, (lo, hi) in enumerate(bounds):
        out[lo:hi] = np.load(parts_dir / f"part-{k:06d}.npy")
    out.flush()
    tmp = Path(out.filename)
    del out
    os.replace(tmp, path)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return np.load(path, mmap_mode="r")


def build_structure(index_dir: Path, identity: dict, workers: int, cache: ShardCache | None,
                    manifest_local: str) -> dict:
    started = time.monotonic()
    parts = plan_parts(identity, cache, manifest_local)
    parts_dir = index_dir.with_name(index_dir.name + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    small = sum(f["size"] or 0 for f in identity["files"]) < MIN_PARALLEL_BYTES
    run_parts(parts_dir, parts, _write_part, (), 1 if small else workers, ".json")
    meta = _merge(index_dir, parts_dir, parts, identity, started)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return meta


def _merge(index_dir: Path, parts_dir: Path, parts: list[dict], identity: dict, started: float) -> dict:
    infos = [json.loads((parts_dir / f"part-{k:06d}.json").read_text()) for k in range(len(parts))]
    total = sum(i["count"] for i in infos)
    tmp = private_tmp(index_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    out = {k: np.lib.format.open_memmap(tmp / f"{k}.npy", mode="w+", dtype=d, shape=(total,))
           for k, d in COLUMNS.items()}
    manifest = identity["kind"] == "manifest"
    name = Path(identity["files"][0]["path"]).name if manifest else ""
    errors = warnings = pos = lines_before = 0
    damaged = []
    with open(tmp / "problems.jsonl", "w", encoding="utf-8") as pf:
        for k, info in enumerate(infos):
            with np.load(parts_dir / f"part-{k:06d}.npz") as arrays:
                n = info["count"]
                for col in COLUMNS:
                    out[col][pos : pos + n] = arrays[col] + (lines_before if col == "line" and manifest else 0)
            for where, reason, level, *lost in info["problems"]:
                where = f"{name}:{where + lines_before}" if manifest else where
                pf.write(json.dumps([where, reason, level], ensure_ascii=False) + "\n")
                errors, warnings = errors + (level == "error"), warnings + (level != "error")
                damaged += [{"where": where, "reason": reason, **lost[0]}] if lost else []
            pos += info["count"]
            lines_before += info.get("lines", 0)
    for array in out.values():
        array.flush()
    del out
    meta = {**identity, "count": total, "errors": errors, "warnings": warnings, "damaged": damaged,
            "build_s": round(time.monotonic() - started, 3)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if index_dir.exists():
        shutil.rmtree(index_dir)  # stale: described other files (a fresh one is never rebuilt)
    os.replace(tmp, index_dir)
    return meta
