"""Caption token counts of an indexed source: a column of its own, one per tokenizer.

Budget batching plans batches from every caption's token count, so those counts are computed
once, next to the sample index, as ``tokens-TOKENIZER-LENGTH.npy`` (uint16). They are the costly
part of indexing (a tokenizer call per caption, against a JSON parse per row), and fixed batching
never reads them, so they are made on first use rather than with the index: the structure of a
billion-row source is indexed at parsing speed, and each tokenizer pays for its own pass once.

The pass reads the source again in the index's own parts (resumable, in parallel processes, by
one process under the build lock), and checks that each part yields the rows the index holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from vltrain.data.index.build import merge_parts, part_rows, plan_parts, run_parts, save_part
from vltrain.data.index.reader import IndexedSource
from vltrain.data.sources.filelock import build_once
from vltrain.data.sources.shard_cache import ShardCache
from vltrain.data.tokenizers import Tokenizer, load_tokenizer
from vltrain.errors import DataError

MAX_LENGTH = int(np.iinfo(np.uint16).max)
MIN_PARALLEL_CAPTIONS = 200_000
"""Fewer captions are counted in this process: starting processes costs seconds."""


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of what decides token counts: the tokenizer without its truncation and padding
    settings, which vltrain sets per call."""
    spec = json.loads(tokenizer.hf.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    if tokenizer.clean:
        spec["text_clean"] = tokenizer.clean
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=8).hexdigest()


def lengths_file(source: IndexedSource, tokenizer: Tokenizer, max_length: int) -> Path:
    return source.index_dir / f"tokens-{tokenizer_fingerprint(tokenizer)}-{max_length}.npy"


def _part_bounds(source: IndexedSource, parts: list[dict]) -> list[tuple[int, int]]:
    """The index rows each part yields: rows whose offset falls in a manifest part's byte range,
    the rows of a group of shards or parquet files, or all of a CSV."""
    if source.kind in ("shards", "parquet"):
        line = source.columns["line"]
        bounds = np.searchsorted(line, np.arange(len(source.files) + 1, dtype=line.dtype))
        return [(int(bounds[p["first"]]), int(bounds[p["first"] + p["count"]])) for p in parts]
    if parts and parts[0]["kind"] == "csv":
        return [(0, len(source))]
    offsets = source.columns["offset"]
    return [(int(np.searchsorted(offsets, p["lo"])), int(np.searchsorted(offsets, p["hi"]))) for p in parts]


def _write_lengths(parts_dir: Path, k: int, part: dict, tokenizer: Tokenizer | tuple[str, str], max_length: int,
                   rows: int) -> None:
    """Token counts of part ``k``'s captions, written (atomically) to ``parts_dir``; ``tokenizer``
    may be its (path, text_clean), to load in a process of its own."""
    if isinstance(tokenizer, tuple):  # in a process of its own
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        tokenizer = load_tokenizer(*tokenizer)
    texts = [text for *_, text in part_rows(part, [])]
    if len(texts) != rows:
        raise DataError(f"{part.get('file') or 'shards'}: {len(texts)} rows where the index holds {rows}; "
                        "the source changed while it was read: run again to index it anew")
    save_part(parts_dir, k, np.asarray(tokenizer.token_lengths(texts, max_length), dtype=np.uint16))


def build_lengths(source: IndexedSource, tokenizer: Tokenizer, max_length: int, *, workers: int = 1,
                  cache: ShardCache | None = None, manifest_local: str = "") -> np.ndarray:
    """The source's caption token counts for ``tokenizer``, memory-mapped; made once (by one process)."""
    if max_length > MAX_LENGTH:
        raise DataError(f"max_text_length {max_length} is too large for the index (at most {MAX_LENGTH} tokens)")
    path = lengths_file(source, tokenizer, max_length)

    def fresh() -> np.ndarray | None:
        return np.load(path, mmap_mode="r") if path.is_file() else None

    def build() -> np.ndarray:
        parts = plan_parts(source.meta, cache, manifest_local or source.files[0])
        bounds = _part_bounds(source, parts)
        parts_dir = path.with_name(path.stem + ".parts")
        parts_dir.mkdir(exist_ok=True)
        parallel = workers > 1 and tokenizer.path and len(source) >= MIN_PARALLEL_CAPTIONS
        run_parts(parts_dir, parts, _write_lengths, ((tokenizer.path, tokenizer.clean) if parallel else tokenizer, max_length),
                  workers if parallel else 1, ".npy",
                  extra=[hi - lo for lo, hi in bounds])
        return merge_parts(parts_dir, bounds, path, np.uint16, (len(source),))

    return build_once(path, fresh, build, what=f"count the caption tokens of {source.name}")
