"""``vltrain data validate`` and ``vltrain data stats``: look at every row before a run does.

validate exits 0 when every row is usable, 1 when problems were found, 2 on a usage error (a
path that does not exist, a format it does not know).
"""

from __future__ import annotations

import glob
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vltrain.data.images import DECODE_ERRORS, MAX_IMAGE_PIXELS, ImageError, decode_seen, image_problem, open_image
from vltrain.data.index.lengths import tokenizer_fingerprint
from vltrain.data.index.open import open_any
from vltrain.data.index.reader import IndexedSource
from vltrain.data.regions import RegionError, check_inside, parse_regions
from vltrain.data.sources.manifests import Problem, Source
from vltrain.data.sources.parquet import is_parquet
from vltrain.data.sources.patterns import is_shard_pattern
from vltrain.data.sources.shards import shard_paths
from vltrain.data.tokenizers import load_tokenizer
from vltrain.errors import DataError, UsageError
from vltrain.runtime.cpus import usable_cpus

CHECK_SIZE = 32
"""Images are fully decoded to this size: it catches truncation without the cost of a full resize."""


@dataclass
class SourceSummary:
    name: str
    rows: int = 0
    image_text: int = 0
    text_only: int = 0
    image_only: int = 0
    errors: int = 0
    warnings: int = 0
    problems: list[Problem] = field(default_factory=list)


def _open(path: str) -> Source:
    """Open a source through its sample index where one exists (no parsing), else by parsing it;
    a path that is not there or not a known format is a usage error."""
    names = shard_paths(path) if is_shard_pattern(path) or is_parquet(path) else [path]
    missing = [n for n in names if not Path(n).exists()]
    if any(glob.has_magic(n) for n in missing):
        raise UsageError(f"{path}: no file matches {next(n for n in missing if glob.has_magic(n))}")
    if missing:
        raise UsageError(f"{path}: not found" + (f" ({len(missing)} of {len(names)} shards)" if len(names) > 1 else ""))
    try:
        return open_any(path)
    except DataError as e:
        if "not a manifest" in str(e):
            raise UsageError(str(e)) from e
        raise


def modality_counts(source: Source) -> tuple[int, int, int]:
    """(image-text, text-only, image-only) rows."""
    has_image = np.asarray(source.has_image())
    has_text = np.asarray(source.has_text()) if isinstance(source, IndexedSource) else \
        np.fromiter((t is not None for t in source.texts()), dtype=bool, count=len(source))
    return int((has_image & has_text).sum()), int((~has_image).sum()), int((~has_text).sum())


def check_rows(source: Source, start: int, stop: int, max_pixels: int = MAX_IMAGE_PIXELS) -> list[Problem]:
    """Read and decode every image of rows ``start:stop`` and check its regions against it; the rows
    that fail, with why (a row's first bad region)."""
    problems = []
    for i in range(start, stop):
        row = source.row(i)
        if row.image is None:
            if row.regions is not None:
                problems.append(Problem(row.where, f"regions on a row without an image are ignored (id {row.key})",
                                        "warning"))
            continue
        try:
            _, seen = decode_seen(source.read_image(i), CHECK_SIZE, "squash", max_pixels)
            if row.regions is not None:
                check_inside(parse_regions(row.regions), seen.width, seen.height)
        except RegionError as e:
            problems.append(Problem(row.where, f"{e} (id {row.key})"))
        except (ImageError, OSError) as e:
            problems.append(Problem(row.where, f"{image_problem(e, row.image)} (id {row.key})"))
    return problems


def _check_source(source: Source, workers: int, progress: bool = False) -> list[Problem]:
    """Every image of ``source`` decoded, in ``workers`` processes (0: one per core); a bar on a
    terminal when ``progress``."""
    from tqdm import tqdm

    n = len(source)
    workers = workers or usable_cpus()
    chunk = max(64, -(-n // (workers * 16)))
    starts = list(range(0, n, chunk))
    bar = tqdm(total=n, desc=f"validating {source.name}", unit="row", disable=not progress, leave=False)
    found: list[Problem] = []
    with bar:
        if workers <= 1 or n < 256:
            for start in starts:
                found += check_rows(source, start, min(start + chunk, n))
                bar.update(min(start + chunk, n) - start)
            return found
        with ProcessPoolExecutor(workers) as pool:
            for start, part in zip(starts, pool.map(check_rows, [source] * len(starts), starts,
                                                    [min(s + chunk, n) for s in starts])):
                found += part
                bar.update(min(start + chunk, n) - start)
    return found


def _duplicates(source: Source, seen: dict[str, str]) -> list[Problem]:
    problems = []
    for row in source.rows():
        first = seen.setdefault(row.key, row.where)
        if first != row.where:
            problems.append(Problem(row.where, f"duplicate id {row.key!r} (first at {first})"))
    return problems


def _position(p: Problem) -> tuple:
    """Problems in file order: "m.jsonl:12" sorts by line number, "00001.tar:KEY" by key."""
    name, _, pos = p.where.rpartition(":")
    return (name, int(pos) if pos.isdigit() else 0, pos)


def validate(paths: list[str], workers: int = 0, progress: bool = False) -> list[SourceSummary]:
    """Every row of every source read and every image decoded (``workers`` processes, 0: one per
    core); a source with no rows is a problem, as training refuses it."""
    summaries, seen = [], {}
    for path in paths:
        s = SourceSummary(path)
        try:
            source = _open(path)
        except DataError as e:
            s.problems.append(Problem(path, str(e)))
            s.errors = 1
            summaries.append(s)
            continue
        s.rows = len(source)
        s.image_text, s.text_only, s.image_only = modality_counts(source)
        found = _duplicates(source, seen) + _check_source(source, workers, progress)
        if s.rows == 0:
            found.append(Problem(path, "no rows: training refuses an empty source (nothing to read in it)"))
        found_errors = sum(p.level == "error" for p in found)
        s.problems = sorted(source.problems + found, key=_position)
        # an index holds its first problems in memory and counts all of them
        warnings = int(source.meta["warnings"]) if isinstance(source, IndexedSource) \
            else len(source.problems) - len(source.errors())
        s.errors = source.error_count() + found_errors
        s.warnings = warnings + len(found) - found_errors
        summaries.append(s)
    return summaries


# -- stats ----------------------------------------------------------------------------------------

PERCENTILES = (5, 50, 95, 99)


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    out = {f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}
    out.update(mean=float(a.mean()), max=float(a.max()))
    return out


def _indexed_lengths(sources: list[Source], tokenizer_path: str | None) -> tuple[list[int] | None, str]:
    """Caption token counts straight from the sample indexes, when every source has one built with
    this tokenizer (capped at the index's max_text_length, which the unit says)."""
    if not tokenizer_path or not all(isinstance(s, IndexedSource) for s in sources):
        return None, ""
    fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer_path))
    files = []
    for s in sources:  # the largest cap each source has counts for
        caps = sorted((int(f.stem.rsplit("-", 1)[1]), f) for f in s.index_dir.glob(f"tokens-{fingerprint}-*.npy"))
        if not caps:
            return None, ""
        files.append(caps[-1])
    lengths = np.concatenate([np.load(f, mmap_mode="r")[np.asarray(s.has_text())] for s, (_, f) in zip(sources, files)])
    return lengths.tolist(), f"tokens, from the index: capped at {max(cap for cap, _ in files)}"


def stats(paths: list[str], tokenizer_path: str | None, max_images: int) -> dict:
    sources = [_open(p) for p in paths]
    counts = np.array([modality_counts(s) for s in sources]).sum(0).tolist()
    lengths, unit = _indexed_lengths(sources, tokenizer_path)
    if lengths is None:
        texts = [t for s in sources for t in s.texts() if t is not None]
        if tokenizer_path:
            lengths, unit = load_tokenizer(tokenizer_path).token_lengths(texts, 1 << 30), "tokens"
        else:
            lengths, unit = [len(t.split()) for t in texts], "words"
    widths, heights, unreadable = [], [], 0
    refs = [(s, i) for s in sources for i in np.flatnonzero(s.has_image()).tolist()]
    step = max(1, len(refs) // max_images) if max_images > 0 else len(refs) + 1
    for s, i in refs[::step][:max_images]:
        try:
            w, h = open_image(s.read_image(i), MAX_IMAGE_PIXELS).size
        except (ImageError, *DECODE_ERRORS):
            unreadable += 1
            continue
        widths.append(w)
        heights.append(h)
    return {
        "sources": paths,
        "rows": sum(counts),
        "image_text": counts[0],
        "text_only": counts[1],
        "image_only": counts[2],
        "caption_length": {"unit": unit, **_percentiles(lengths)},
        "images_measured": len(widths),
        "images_unreadable": unreadable,
        "damaged": [d for s in sources for d in s.damaged],
        "image_width": _percentiles(widths),
        "image_height": _percentiles(heights),
    }
