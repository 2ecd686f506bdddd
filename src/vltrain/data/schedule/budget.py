"""Budget batching: batches packed under a token budget and an image budget.

A batch costs ``rows x padded width`` text positions, where the width is the longest row rounded
up to ``data.pad_multiple`` (the collator pads the same way), and one image slot per row with an image.
Rows are grouped by modality (image-text, text-only, image-only) so a batch never mixes them,
and sorted by padded width inside large shuffled windows ("megabatches", as in LLaVA's
modality-length grouping) so a batch holds similar lengths while batch composition still
changes from epoch to epoch. Packing is pure numpy on the sample table: every rank runs it on
the same inputs and gets the same schedule, so step counts agree without communication.
"""

from __future__ import annotations

import numpy as np

from vltrain.data.config import PAD_MULTIPLE, padded_width
from vltrain.data.table import SampleTable
from vltrain.errors import UserError

MEGABATCH = 32
"""A length-sorting window holds this many batch_size-sized batches."""


def _widths(text_len: np.ndarray, multiple: int = PAD_MULTIPLE) -> np.ndarray:
    text_len = np.asarray(text_len, dtype=np.int64)  # the index stores uint16, which cannot be negated
    return np.maximum(multiple, -(-text_len // multiple) * multiple)


def batch_tokens(text_len: np.ndarray, multiple: int = PAD_MULTIPLE) -> int:
    """Text positions a batch with these row lengths computes (the token budget's unit)."""
    return len(text_len) * padded_width(int(text_len.max()), multiple) if len(text_len) else 0


def modality(table: SampleTable, rows: np.ndarray) -> np.ndarray:
    """0 image-text, 1 text-only, 2 image-only (rows with neither are grouped with image-only)."""
    img, txt = table.has_image[rows], table.has_text[rows]
    return np.where(img & txt, 0, np.where(txt, 1, 2))


def _pack_sorted(rows: np.ndarray, lens: np.ndarray, imgs: np.ndarray, batch_size: int,
                 token_budget: int, image_budget: int, multiple: int) -> list[np.ndarray]:
    """Greedy packing of rows already sorted by padded width: a batch closes when one more row
    would not fit (a single row always fits).

    Each batch is found in one step rather than row by row. Widths only grow along the rows, so
    for a batch starting at row ``a`` the rows that fit form a prefix, ended by the first of: the
    row count, the image count (a search in the running image sum) and, per run of one width
    ``w``, the first row past ``a + token_budget // w - 1``. Runs of one width are few (about
    ``max_text_length / multiple``), so packing costs O(batches x runs), not a Python step per row.
    """
    n = len(rows)
    if n == 0:
        return []
    widths = _widths(np.asarray(lens, dtype=np.int64), multiple)
    run_starts = np.flatnonzero(np.r_[True, widths[1:] != widths[:-1]])
    run_caps = token_budget // widths[run_starts]  # rows of that width a batch may hold
    run_ends = np.r_[run_starts[1:], n]
    images = np.r_[0, np.cumsum(np.asarray(imgs, dtype=np.int64))]
    bounds, a, run = [0], 0, 0
    while a < n:
        while run_ends[run] <= a:
            run += 1
        end = min(n, a + batch_size, int(np.searchsorted(images, images[a] + image_budget, side="right")) - 1)
        r = run
        while r < len(run_starts) and run_starts[r] < end:
            stop = max(int(run_starts[r]), a + int(run_caps[r]))  # first row of this run that overflows
            if stop < min(end, int(run_ends[r])):
                end = stop
                break
            r += 1
        a = max(end, a + 1)
        bounds.append(a)
    return np.split(rows, bounds[1:-1])


def pack(
    order: np.ndarray,
    table: SampleTable,
    *,
    batch_size: int,
    token_budget: int,
    image_budget: int,
    rng: np.random.Generator | None,
    pad_multiple: int = PAD_MULTIPLE,
) -> list[np.ndarray]:
    """Batches of dataset indices covering ``order`` exactly once, each within every budget.

    ``rng`` shuffles the batch order (None keeps modality-then-length order, for shuffle=False).
    With ``pad_multiple`` 1 rows are grouped by exact length.
    """
    if len(order) == 0:
        return []
    widest = padded_width(int(table.text_len[order].max()), pad_multiple)
    if widest > token_budget:
        raise UserError(
            f"data.token_budget={token_budget} is smaller than one padded caption ({widest} positions); "
            f"raise it to at least {widest}"
        )
    if image_budget < 1 and np.any(table.has_image[order]):
        raise UserError(f"data.image_budget={image_budget} leaves no room for an image; set it >= 1")
    mods = modality(table, order)
    window = batch_size * MEGABATCH
    batches: list[np.ndarray] = []
    for m in range(3):
        rows = order[mods == m]  # keeps the epoch's (shuffled) order inside the modality
        for w in range(0, len(rows), window):
            chunk = rows[w : w + window]
            # Sort by padded width, not length: rows of one width cost the same, so their
            # (shuffled) order is kept and batch composition changes from epoch to epoch.
            chunk = chunk[np.argsort(_widths(table.text_len[chunk], pad_multiple), kind="stable")]
            batches += _pack_sorted(chunk, table.text_len[chunk], table.has_image[chunk], batch_size,
                                    token_budget, image_budget, pad_multiple)
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def split_to_multiple(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Split the largest batches in two until the count is a multiple of ``world_size``.

    Halving a batch keeps both halves within every budget, so this equalizes step counts across
    ranks without repeating or dropping a sample. Falls short of a multiple only when every batch
    is down to one row (the epoch has fewer rows than the next multiple of the world size's batch
    count, e.g. a handful of rows packed one per batch); the caller pads or drops then.
    """
    batches = list(batches)
    while len(batches) % world_size:
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        i = int(np.argmax(sizes))
        if sizes[i] < 2:
            break
        half = sizes[i] // 2
        batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
    return batches
