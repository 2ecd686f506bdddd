"""Image sizes of a source, read from the images' headers: what patch-budget batching plans with.

With ``data.resize: native`` an image's cost in a step is the patch grid it is resized to, which
its width and height decide (``native.native_grid``). ``data.patch_budget`` packs batches by that
cost, so every image's size is needed before any image is decoded. Reading a header is cheap next
to decoding, yet it still reads every image once (most of a shard's bytes), so, like the token
counts, the sizes are a column of their own next to the sample index, ``image-sizes.npy``
(uint32 [n, 2]: height and width as the image is shown, after its EXIF orientation), made on first
use by one process, in parts that an interrupted pass keeps.

A row without an image, and one whose header cannot be read, has size 0 x 0; the loader counts the
second as a bad sample when it gets there, as it would have without the sizes.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from vltrain.data.images import DECODE_ERRORS, shown_size
from vltrain.data.index.build import merge_parts, run_parts, save_part
from vltrain.data.index.reader import IndexedSource
from vltrain.data.sources.filelock import build_once
from vltrain.data.sources.manifests import Source

SIZES_FILE = "image-sizes.npy"
PART_ROWS = 20_000
"""Rows read per part of the pass (a part is the unit an interrupted pass resumes from)."""
MIN_PARALLEL_ROWS = 100_000
"""Fewer rows are read in this process: starting processes costs seconds."""


def header_size(data: bytes) -> tuple[int, int]:
    """(height, width) of an encoded image as shown (its EXIF orientation applied), from its header;
    (0, 0) when the header cannot be read. The orientation is the decoders' (``images.shown_size``)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return shown_size(im)
    except (UnidentifiedImageError, Image.DecompressionBombError, *DECODE_ERRORS):
        return 0, 0


def read_sizes(source: Source, lo: int, hi: int) -> np.ndarray:
    """Sizes of rows ``lo`` to ``hi`` of ``source`` (uint32 [hi - lo, 2]), reading each image."""
    has_image = np.asarray(source.has_image()[lo:hi])
    out = np.zeros((hi - lo, 2), dtype=np.uint32)
    for k in np.flatnonzero(has_image).tolist():
        try:
            data = source.read_image(lo + k)
        except (OSError, ValueError):  # a missing or unreadable file: a bad sample when it is loaded
            continue
        out[k] = header_size(data)
    return out


def _write_part(parts_dir: Path, k: int, part: dict, source: IndexedSource) -> None:
    save_part(parts_dir, k, read_sizes(source, part["lo"], part["hi"]))


def build_sizes(source: IndexedSource, *, workers: int = 1) -> np.ndarray:
    """The source's image sizes, memory-mapped; read once (by one process), in ``workers`` processes
    for a large source."""
    path = source.index_dir / SIZES_FILE
    n = len(source)

    def fresh() -> np.ndarray | None:
        return np.load(path, mmap_mode="r") if path.is_file() else None

    def build() -> np.ndarray:
        parts = [{"lo": lo, "hi": min(n, lo + PART_ROWS)} for lo in range(0, n, PART_ROWS)]
        parts_dir = path.with_name(path.stem + ".parts")
        parts_dir.mkdir(exist_ok=True)
        run_parts(parts_dir, parts, _write_part, (source,), workers if n >= MIN_PARALLEL_ROWS else 1, ".npy")
        return merge_parts(parts_dir, [(p["lo"], p["hi"]) for p in parts], path, np.uint32, (n, 2))

    return build_once(path, fresh, build, what=f"read the image sizes of {source.name}")


def image_sizes(source: Source, *, workers: int = 1) -> np.ndarray:
    """(height, width) of every row's image, 0 x 0 without one: stored beside an index, read
    directly from any other source."""
    if isinstance(source, IndexedSource):
        return build_sizes(source, workers=workers)
    return read_sizes(source, 0, len(source))
