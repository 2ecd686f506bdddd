"""Building a source's sample index (``index.py``): once, in parallel, resumable.

The work is cut into parts: byte ranges of a JSONL manifest (a row belongs to the part its first
byte falls in), groups of tar shards, or a CSV manifest whole (a quoted field may hold a line
break, so a CSV cannot be split blindly). Each part is parsed and its captions tokenized by one
process, and written to ``INDEX.parts/`` as soon as it is done, so an interrupted build (a killed
job, a preempted node) resumes with the parts still missing. The parts are then merged into the
index folder, which appears under its final name in one rename.

The index is keyed by what it depends on: the files (path, size, modification time), the
tokenizer (a hash of its JSON) and ``max_text_length``. Change any of them and another index is
built; a stale one is never read.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from vltrain.data.config import CsvConfig
from vltrain.data.index import COLUMNS, INDEX_VERSION, IndexedSource, read_meta
from vltrain.data.filelock import build_once, private_tmp
from vltrain.data.remote import ShardCache, expand_remote, filesystem, is_remote, stat_remote
from vltrain.data.shards import default_cache_dir, scan_samples, shard_paths
from vltrain.data.sources import (IMAGE_KEYS, MANIFEST_SUFFIXES, TEXT_KEYS, check_row, csv_columns, csv_fields,
                                  csv_separator, is_shard_pattern, json_fields)
from vltrain.data.text import Tokenizer, load_tokenizer
from vltrain.errors import DataError, UsageError

PART_BYTES = 64 << 20
"""A JSONL manifest is parsed in parts of about this many bytes."""
SHARDS_PER_PART = 8


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of what decides token counts: the tokenizer without its truncation and padding
    settings, which vltrain sets per call."""
    spec = json.loads(tokenizer.hf.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=8).hexdigest()


def _describe(files: list[str]) -> list[dict]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append({"path": f, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _describe_remote(urls: list[str], storage_options: dict | None) -> list[dict]:
    """Size and version of remote objects from one listing per folder (not a request per shard)."""
    fs, _ = filesystem(urls[0], storage_options)
    scheme = urls[0].split("://", 1)[0]
    listed: dict[str, dict] = {}
    for parent in dict.fromkeys(u.rsplit("/", 1)[0] for u in urls):
        try:
            entries = fs.ls(parent.split("://", 1)[1], detail=True)
        except (OSError, ValueError) as e:
            raise DataError(f"{parent}: cannot list it ({e}); check the bucket name, data.storage_options, "
                            "AWS_ENDPOINT_URL and the credentials") from e
        for e in entries:
            version = next((str(e[k]) for k in ("ETag", "etag", "generation", "LastModified", "mtime") if e.get(k)), "")
            listed[f"{scheme}://{e['name']}"] = {"size": e.get("size"), "version": version}
    missing = [u for u in urls if u not in listed]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{len(missing)} of {len(urls)} remote object(s) not found: {shown}")
    return [{"path": u, **listed[u]} for u in urls]


def source_files(spec: str, storage_options: dict | None = None) -> tuple[str, list[dict]]:
    """("manifest" | "shards", the files of a source path with their size and version), every
    one present."""
    if is_remote(spec):
        if is_shard_pattern(spec):
            return "shards", _describe_remote(expand_remote(spec, storage_options), storage_options)
        if Path(spec).suffix.lower() not in MANIFEST_SUFFIXES:
            raise DataError(f"{spec}: not a manifest (.jsonl, .csv, .tsv) or a tar shard pattern")
        return "manifest", [{"path": spec, **stat_remote(spec, storage_options)}]
    if is_shard_pattern(spec):
        files = shard_paths(spec)
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise DataError(f"{spec}: {len(missing)} of {len(files)} shard(s) not found: {shown}")
        return "shards", _describe(files)
    if Path(spec).suffix.lower() not in MANIFEST_SUFFIXES:
        raise DataError(f"{spec}: not a manifest (.jsonl, .csv, .tsv) or a tar shard pattern ('dir/{{00000..00009}}.tar')")
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


def open_indexed(spec: str, tokenizer: Tokenizer, max_text_length: int, csv_cfg: CsvConfig | None = None,
                 cache_dir: str | os.PathLike | None = None, workers: int = 1, *,
                 storage_options: dict | None = None, cache_limit_gb: float = 50.0) -> IndexedSource:
    """The source ``spec`` read through its sample index, built first when missing or stale
    (by one process: the others wait for it). Remote sources (s3://, gs://, https://) are read
    through a shard cache in ``cache_dir`` holding at most ``cache_limit_gb``."""
    kind, described = source_files(spec, storage_options)
    files = [f["path"] for f in described]
    cache = ShardCache(cache_root(cache_dir), int(cache_limit_gb * 2**30), storage_options) if is_remote(spec) \
        else None
    manifest_local = files[0] if cache is None or kind != "manifest" else str(cache.local(files[0], described[0]))
    csv_spec = _csv_spec(manifest_local, csv_cfg or CsvConfig()) if kind == "manifest" \
        and not files[0].endswith(".jsonl") else None
    identity = {"version": INDEX_VERSION, "kind": kind, "files": described, "csv": csv_spec,
                "tokenizer": tokenizer_fingerprint(tokenizer), "max_text_length": max_text_length}
    key = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=6).hexdigest()
    index_dir = index_dir_for(spec, files, key, cache_dir)

    def fresh() -> dict | None:
        meta = read_meta(index_dir)
        same = meta is not None and all(meta.get(k) == v for k, v in identity.items())
        return meta if same else None

    built = []

    def build() -> dict:
        built.append(True)
        return _build(index_dir, identity, tokenizer, workers, cache, manifest_local)

    meta = build_once(index_dir, fresh, build, what=f"index {spec}")
    source = IndexedSource(spec, index_dir, meta, cache)
    source.built_now = bool(built)
    return source


def existing_index(spec: str, cache_dir: str | os.PathLike | None = None) -> IndexedSource | None:
    """A fresh sample index of local source ``spec`` built with any tokenizer (the newest), or None.

    For tools that need the rows and modalities but no token counts (``data validate``)."""
    if is_remote(spec):
        return None
    try:
        kind, described = source_files(spec)
    except DataError:
        return None
    name = index_dir_for(spec, [f["path"] for f in described], "", cache_dir).name  # "NAME-"
    places = [Path(described[0]["path"]).parent / ".vltrain-index", cache_root(cache_dir) / "index"]
    found = [(meta.get("build_s", 0), d, meta) for place in places if place.is_dir()
             for d in place.glob(f"*{name}*") if d.is_dir() and not d.name.endswith(".parts")
             for meta in [read_meta(d)] if meta and meta.get("files") == described and meta.get("kind") == kind
             and meta.get("version") == INDEX_VERSION]
    if not found:
        return None
    newest = max(found, key=lambda f: f[1].stat().st_mtime)
    return IndexedSource(spec, newest[1], newest[2])


def _csv_spec(path: str, cfg: CsvConfig) -> dict:
    sep = csv_separator(Path(path), cfg)
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        header = next(csv.reader(f, delimiter=sep), None)
    if header is None:
        raise DataError(f"{path}: empty file (a header row is needed)")
    image_col, text_col, id_col = csv_columns(header, cfg, path)
    return {"separator": sep, "header": header, "image_col": image_col, "text_col": text_col, "id_col": id_col}


# -- parts ----------------------------------------------------------------------------------------


def _plan_parts(identity: dict, cache: ShardCache | None, manifest_local: str) -> list[dict]:
    """The parts of a build; shards are read through the cache (downloaded) when remote."""
    if identity["kind"] == "shards":
        files = identity["files"]
        return [{"kind": "shards", "files": files, "first": i, "count": min(SHARDS_PER_PART, len(files) - i),
                 "cache": cache} for i in range(0, len(files), SHARDS_PER_PART)]
    size = os.path.getsize(manifest_local)
    if identity["csv"] is not None:
        return [{"kind": "csv", "file": manifest_local, "lo": 0, "hi": size, "csv": identity["csv"]}]
    return [{"kind": "jsonl", "file": manifest_local, "lo": lo, "hi": min(size, lo + PART_BYTES)}
            for lo in range(0, max(size, 1), PART_BYTES)]


def _jsonl_rows(part: dict):
    """(local line, byte offset, bytes, fields or None, why) of the lines starting in [lo, hi)."""
    with open(part["file"], "rb") as f:
        pos = part["lo"]
        if pos > 0:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the first line that starts at or after lo
        line = 0
        while pos < part["hi"]:
            raw = f.readline()
            if not raw:
                break
            line += 1
            start, pos = pos, pos + len(raw)
            if raw.strip():
                fields, why = json_fields(raw)
                yield line, start, len(raw), fields, why
        part["lines"] = line


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


def _manifest_part(part: dict, tokenizer: Tokenizer, max_len: int) -> tuple[dict, list, dict]:
    name = Path(part["file"]).name
    if part["kind"] == "csv":
        spec = part["csv"]
        keys = (spec["id_col"], _cols(spec["image_col"]), _cols(spec["text_col"]))
        rows = _csv_rows(part)
    else:
        keys, rows = ("id", IMAGE_KEYS, TEXT_KEYS), _jsonl_rows(part)
    cols: dict[str, list] = {k: [] for k in ("offset", "length", "line", "has_image", "has_text")}
    texts, problems = [], []
    for line, start, length, fields, why in rows:
        row, found = (None, []) if why else check_row(fields, *keys, name, line)
        problems += [[line, why, "error"]] if why else [[line, p.reason, p.level] for p in found]
        if row is None:
            continue
        for k, v in zip(cols, (start, length, line, row[1] is not None, row[2] is not None)):
            cols[k].append(v)
        texts.append(row[2])
    cols["text_len"] = tokenizer.token_lengths(texts, max_len)
    return cols, problems, {"lines": part.get("lines", 0)}


def _cols(column: str | None) -> tuple[str, ...]:
    return (column,) if column else ()


def _shard_part(part: dict, tokenizer: Tokenizer, max_len: int) -> tuple[dict, list, dict]:
    cols: dict[str, list] = {k: [] for k in ("offset", "length", "line", "has_image", "has_text")}
    texts, problems = [], []
    cache = part["cache"]
    for s in range(part["first"], part["first"] + part["count"]):
        described = part["files"][s]
        path = described["path"]
        samples, found = scan_samples(cache.local(path, described) if cache is not None else Path(path))
        problems += [[f"{path.rsplit('/', 1)[-1]}:{key}", reason, level] for key, reason, level in found]
        for _key, _sid, image, text, start, end in samples:
            for k, v in zip(cols, (start, end - start, s, image is not None, text is not None)):
                cols[k].append(v)
            texts.append(text)
    cols["text_len"] = tokenizer.token_lengths(texts, max_len)
    return cols, problems, {}


def _write_part(parts_dir: Path, k: int, part: dict, tokenizer: Tokenizer | str, max_len: int) -> None:
    """Parse part ``k`` and write it (atomically) to ``parts_dir``; skipped when already there."""
    done = parts_dir / f"part-{k:06d}.json"
    if done.is_file():
        return
    if isinstance(tokenizer, str):  # in a build process of its own
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        tokenizer = load_tokenizer(tokenizer)
    make = _shard_part if part["kind"] == "shards" else _manifest_part
    cols, problems, extra = make(part, tokenizer, max_len)
    arrays = {k: np.asarray(cols[k], dtype=dtype) for k, dtype in COLUMNS.items()}
    if arrays["text_len"].size and int(np.max(cols["text_len"])) > np.iinfo(np.uint16).max:
        raise DataError(f"max_text_length {max_len} is too large for the index (at most 65535 tokens)")
    tmp = private_tmp(parts_dir / f"part-{k:06d}.npz")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, parts_dir / f"part-{k:06d}.npz")
    tmp = private_tmp(done)
    tmp.write_text(json.dumps({"count": len(arrays["offset"]), "problems": problems, **extra}, ensure_ascii=False))
    os.replace(tmp, done)


def _run_parts(parts_dir: Path, parts: list[dict], tokenizer: Tokenizer, max_len: int, workers: int) -> None:
    todo = [k for k in range(len(parts)) if not (parts_dir / f"part-{k:06d}.json").is_file()]
    if workers > 1 and len(todo) > 1 and tokenizer.path:
        ctx = get_context("spawn")  # not fork: the parent may hold threads (tokenizers, torch)
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx) as pool:
            for f in [pool.submit(_write_part, parts_dir, k, parts[k], tokenizer.path, max_len) for k in todo]:
                f.result()
    else:
        for k in todo:
            _write_part(parts_dir, k, parts[k], tokenizer, max_len)


def _build(index_dir: Path, identity: dict, tokenizer: Tokenizer, workers: int, cache: ShardCache | None,
           manifest_local: str) -> dict:
    started = time.monotonic()
    parts = _plan_parts(identity, cache, manifest_local)
    parts_dir = index_dir.with_name(index_dir.name + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    _run_parts(parts_dir, parts, tokenizer, identity["max_text_length"], workers)
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
    with open(tmp / "problems.jsonl", "w", encoding="utf-8") as pf:
        for k, info in enumerate(infos):
            with np.load(parts_dir / f"part-{k:06d}.npz") as arrays:
                n = info["count"]
                for col in COLUMNS:
                    out[col][pos : pos + n] = arrays[col] + (lines_before if col == "line" and manifest else 0)
            for where, reason, level in info["problems"]:
                where = f"{name}:{where + lines_before}" if manifest else where
                pf.write(json.dumps([where, reason, level], ensure_ascii=False) + "\n")
                errors, warnings = errors + (level == "error"), warnings + (level != "error")
            pos += info["count"]
            lines_before += info.get("lines", 0)
    for array in out.values():
        array.flush()
    del out
    meta = {**identity, "count": total, "errors": errors, "warnings": warnings,
            "build_s": round(time.monotonic() - started, 3)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if index_dir.exists():
        shutil.rmtree(index_dir)  # stale: described other files (a fresh one is never rebuilt)
    os.replace(tmp, index_dir)
    return meta


def index_cli(args) -> int:
    """``vltrain data index SOURCES... --tokenizer T``: build (or find) each source's sample index.

    Exit 0 clean, 1 when rows were dropped as malformed (they are listed in the index's
    problems.jsonl), 2 on a usage error."""
    tokenizer_path, max_len, csv_cfg, cache_dir = args.tokenizer, args.max_text_length, CsvConfig(), args.cache_dir
    storage_options, cache_limit_gb = None, 50.0
    if args.config:
        from vltrain.config import load_config  # the job config sits above the data layer

        cfg = load_config(args.config)
        tokenizer_path = tokenizer_path or cfg.data.tokenizer
        max_len = max_len or cfg.data.max_text_length
        csv_cfg, cache_dir = cfg.data.csv, cache_dir or cfg.data.cache_dir
        storage_options, cache_limit_gb = cfg.data.storage_options, cfg.data.cache_limit_gb
    if not tokenizer_path:
        raise UsageError("give --tokenizer TOKENIZER.json (or --config CONFIG whose data.tokenizer names one): "
                        "the index stores each caption's token count")
    tokenizer = load_tokenizer(tokenizer_path)
    workers = args.workers or os.cpu_count() or 1
    dropped = 0
    for spec in args.sources:
        started = time.monotonic()
        try:
            source_files(spec, storage_options)
        except DataError as e:
            raise UsageError(str(e)) from None  # a source that is not there: the command was misused
        source = open_indexed(spec, tokenizer, max_len or 77, csv_cfg, cache_dir or None, workers=workers,
                              storage_options=storage_options, cache_limit_gb=cache_limit_gb)
        took = time.monotonic() - started
        meta = source.meta
        how = (f"built in {took:.1f} s ({len(source) / max(took, 1e-9):,.0f} rows/s, {workers} process(es))"
               if source.built_now else "up to date")
        print(f"{spec}: {len(source):,} samples, {meta['errors']} malformed row(s) dropped, "
              f"{meta['warnings']} warning(s); index {how}\n  {source.index_dir}")
        for p in source.errors()[:5]:
            print(f"  dropped {p}")
        dropped += meta["errors"]
    return 1 if dropped else 0
