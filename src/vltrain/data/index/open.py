"""Opening a source through its sample index: find it or build it, and its token counts.

``open_indexed`` is what datasets call; ``vltrain data index`` builds ahead of time. The pieces:
``reader.py`` reads an index, ``build.py`` builds one, ``lengths.py`` adds the caption
token counts of a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vltrain.data.config import CsvConfig
from vltrain.data.index.build import build_structure, cache_root, csv_spec, index_dir_for, source_files
from vltrain.data.index.lengths import build_lengths, lengths_file
from vltrain.data.index.reader import INDEX_VERSION, IndexedSource, read_meta
from vltrain.data.sources.filelock import build_once
from vltrain.data.sources.manifests import Source
from vltrain.data.sources.open import open_source
from vltrain.data.sources.parquet import UnreadableParquet, is_parquet, parquet_columns
from vltrain.data.sources.remote import RETRIES, is_remote
from vltrain.data.sources.shard_cache import ShardCache
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import DataError


def open_indexed(spec: str, tokenizer: Tokenizer | None, max_text_length: int, csv_cfg: CsvConfig | None = None,
                 cache_dir: str | os.PathLike | None = None, workers: int = 1, *,
                 storage_options: dict | None = None, cache_limit_gb: float = 50.0,
                 retries: int = RETRIES) -> IndexedSource:
    """The source ``spec`` read through its sample index, built first when missing or stale (by
    one process: the others wait for it). Its token counts for ``tokenizer`` are made on first use
    (``source.text_len()``). Remote sources (s3://, gs://, https://) are read through a shard
    cache in ``cache_dir`` holding at most ``cache_limit_gb``."""
    kind, described = source_files(spec, storage_options)
    files = [f["path"] for f in described]
    cache = ShardCache(cache_root(cache_dir), int(cache_limit_gb * 2**30), storage_options, retries=retries) \
        if is_remote(spec) \
        else None
    manifest_local = files[0] if cache is None or kind == "shards" else str(cache.local(files[0], described[0]))
    csv = csv_spec(manifest_local, csv_cfg or CsvConfig()) if kind == "manifest" \
        and not files[0].endswith(".jsonl") else None
    identity = {"version": INDEX_VERSION, "kind": kind, "files": described, "csv": csv}
    if kind == "parquet":  # the columns of the first file (every file must have them)
        identity["parquet"] = _columns([manifest_local] if cache is not None else files, csv_cfg)
    key = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=6).hexdigest()
    index_dir = index_dir_for(spec, files, key, cache_dir)

    def fresh() -> dict | None:
        meta = read_meta(index_dir)
        same = meta is not None and all(meta.get(k) == v for k, v in identity.items())
        return meta if same else None

    built = []

    def build() -> dict:
        built.append(True)
        return build_structure(index_dir, identity, workers, cache, manifest_local)

    meta = build_once(index_dir, fresh, build, what=f"index {spec}")
    source = IndexedSource(spec, index_dir, meta, cache)
    source.built_now = bool(built)
    if tokenizer is not None:
        source.lengths_file = lengths_file(source, tokenizer, max_text_length)
        source.lengths = lambda: build_lengths(source, tokenizer, max_text_length, workers=workers, cache=cache,
                                               manifest_local=manifest_local)
    return source


def _columns(paths: list[str], csv_cfg: CsvConfig | None) -> dict:
    """The columns of the first readable file of a parquet source (a damaged one is counted by
    the build, not refused here)."""
    for k, path in enumerate(paths):
        try:
            return parquet_columns(path, csv_cfg)
        except UnreadableParquet:
            if k == len(paths) - 1:
                raise
    raise DataError("no parquet files")


def existing_index(spec: str, cache_dir: str | os.PathLike | None = None) -> IndexedSource | None:
    """A fresh sample index of local source ``spec`` (the newest), or None: for tools that read
    rows and modalities (``data validate``, ``data stats``) without building anything."""
    if is_remote(spec):
        return None
    try:
        kind, described = source_files(spec)
    except DataError:
        return None
    name = index_dir_for(spec, [f["path"] for f in described], "", cache_dir).name  # "NAME-"
    places = [Path(described[0]["path"]).parent / ".vltrain-index", cache_root(cache_dir) / "index"]
    found = [(d, meta) for place in places if place.is_dir()
             for d in place.glob(f"*{name}*") if d.is_dir() and not d.name.endswith(".parts")
             for meta in [read_meta(d)] if meta and meta.get("files") == described and meta.get("kind") == kind
             and meta.get("version") == INDEX_VERSION]
    if not found:
        return None
    index_dir, meta = max(found, key=lambda f: f[0].stat().st_mtime)
    return IndexedSource(spec, index_dir, meta)


def open_any(spec: str, csv_cfg: CsvConfig | None = None) -> Source:
    """For tools that read a source once (``data validate``, ``data stats``, ``data shard``,
    ``tokenizer train``): its fresh sample index where one exists; else a manifest or shard
    pattern parsed as it is, or a parquet source indexed (its rows are only reachable so)."""
    found = existing_index(spec)
    if found is not None:
        return found
    if is_parquet(spec):
        return open_indexed(spec, None, 77, csv_cfg)
    return open_source(spec, csv_cfg)
