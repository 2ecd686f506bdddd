"""Budget batching: batches packed under a token budget, an image budget and a patch budget.

A batch costs ``rows x padded width`` text positions, where the width is the longest row rounded
up to ``data.pad_multiple`` (the collator pads the same way), one image slot per row with an image
and, with images at their own shape and ``data.patch_budget``, the patches of every image's grid.
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


def _costs(table: SampleTable, rows: np.ndarray, image_budget: int, patch_budget: int) -> list[tuple[np.ndarray, int]]:
    """What each of ``rows`` spends of the budgets besides text: an image slot, and its patches
    under a patch budget."""
    costs = [(table.has_image[rows], image_budget)]
    if patch_budget:
        costs.append((table.patches[rows], patch_budget))
    return costs


def _pack_sorted(rows: np.ndarray, lens: np.ndarray, costs: list[tuple[np.ndarray, int]], batch_size: int,
                 token_budget: int, multiple: int) -> list[np.ndarray]:
    """Greedy packing of rows already sorted by padded width: a batch closes when one more row
    would not fit (a single row always fits). ``costs`` pairs a per-row cost with its budget.

    Each batch is found in one step rather than row by row. Widths only grow along the rows, so
    for a batch starting at row ``a`` the rows that fit form a prefix, ended by the first of: the
    row count, each cost's budget (a search in the running sum of that cost) and, per run of one
    width ``w``, the first row past ``a + token_budget // w - 1``. Runs of one width are few (about
    ``max_text_length / multiple``), so packing costs O(batches x runs), not a Python step per row.
    """
    n = len(rows)
    if n == 0:
        return []
    widths = _widths(np.asarray(lens, dtype=np.int64), multiple)
    run_starts = np.flatnonzero(np.r_[True, widths[1:] != widths[:-1]])
    run_caps = token_budget // widths[run_starts]  # rows of that width a batch may hold
    run_ends = np.r_[run_starts[1:], n]
    sums = [(np.r_[0, np.cumsum(np.asarray(cost, dtype=np.int64))], limit) for cost, limit in costs]
    bounds, a, run = [0], 0, 0
    while a < n:
        while run_ends[run] <= a:
            run += 1
        end = min(n, a + batch_size, *(int(np.searchsorted(total, total[a] + limit, side="right")) - 1
                                       for total, limit in sums))
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
    patch_budget: int = 0,
) -> list[np.ndarray]:
    """Batches of dataset indices covering ``order`` exactly once, each within every budget.

    ``rng`` shuffles the batch order (None keeps modality-then-length order, for shuffle=False).
    With ``pad_multiple`` 1 rows are grouped by exact length. ``patch_budget`` (0: none) counts the
    table's patches.
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
    if patch_budget and len(order) and int(table.patches[order].max()) > patch_budget:
        raise UserError(f"data.patch_budget={patch_budget} is smaller than one image's "
                        f"{int(table.patches[order].max())} patches; raise it to at least data.max_patches")
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
            batches += _pack_sorted(chunk, table.text_len[chunk], _costs(table, chunk, image_budget, patch_budget),
                                    batch_size, token_budget, pad_multiple)
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


# ---------------------------------------------------------------------------------------------
# Global steps: budget batching under data.global_batch_size


def min_step_rows(global_batch: int) -> int:
    """The fewest rows a global budget step holds: a quarter of the global batch."""
    return max(1, global_batch // 4)


def check_step_budgets(global_batch: int, token_budget: int, image_budget: int, max_text_length: int,
                       multiple: int = PAD_MULTIPLE, patch_budget: int = 0, max_patches: int = 0) -> None:
    """Refuse step budgets under which a step could not hold :func:`min_step_rows` (twice over,
    so that a short last step can always be merged with its neighbour)."""
    need = 2 * min_step_rows(global_batch)
    tokens = need * padded_width(max_text_length, multiple)
    if token_budget < tokens:
        raise UserError(f"data.token_budget={token_budget} is too small for data.global_batch_size={global_batch}: "
                        f"with a global batch the budgets are the whole step's, and a step must hold at least "
                        f"{need} captions of data.max_text_length; set it to at least {tokens}, or 0 (automatic)")
    if image_budget < need:
        raise UserError(f"data.image_budget={image_budget} is too small for data.global_batch_size={global_batch}: "
                        f"a step's images must fit at least {need} rows; set it to at least {need}, or 0 (automatic)")
    if patch_budget and patch_budget < need * max_patches:
        raise UserError(f"data.patch_budget={patch_budget} is too small for data.global_batch_size={global_batch}: "
                        f"a step must hold at least {need} images of data.max_patches ({max_patches}); set it to "
                        f"at least {need * max_patches}, or 0 (no patch budget)")


def _balance_last(steps: list[np.ndarray], table: SampleTable, least: int, multiple: int) -> list[np.ndarray]:
    """Make a short last step (fewer than ``least`` rows) whole: it takes the widest rows of the
    step before until it holds ``least`` (what is left of that step stays within its budgets, being
    a part of it), or the two merge when together they hold fewer than ``2 x least`` (within every
    budget, by :func:`check_step_budgets`)."""
    if not steps or len(steps[-1]) >= least:
        return steps
    if len(steps) == 1:
        raise UserError(f"a window of the epoch holds {len(steps[0])} rows, fewer than a budget step's least "
                        f"{least} (a quarter of data.global_batch_size): lower data.global_batch_size, or use a "
                        "larger data.shuffle_window")
    before, last = steps[-2], steps[-1]
    if len(before) + len(last) < 2 * least:
        return steps[:-2] + [np.concatenate([before, last])]
    before = before[np.argsort(_widths(table.text_len[before], multiple), kind="stable")]
    cut = len(before) - (least - len(last))
    return steps[:-2] + [before[:cut], np.concatenate([before[cut:], last])]


def pack_steps(
    order: np.ndarray,
    table: SampleTable,
    *,
    global_batch: int,
    slots: int,
    token_budget: int,
    image_budget: int,
    rng: np.random.Generator | None,
    pad_multiple: int = PAD_MULTIPLE,
    patch_budget: int = 0,
) -> list[np.ndarray]:
    """Global steps of ``order``, each dealt to ``slots`` micro-batches: the step's rows are
    decided for the whole world, then split.

    A step holds at most ``global_batch`` rows, ``token_budget`` padded text positions,
    ``image_budget`` images and ``patch_budget`` patches (the step's budgets, not a micro-batch's), one modality where it can
    (the rows each modality leaves over are packed together), and at least a quarter of
    ``global_batch`` rows. None of that depends on ``slots``: every split of the world sees the same
    steps. Each step is then cut into ``slots`` runs of its width-sorted rows, equal in count to
    within one, so the micro-batches are balanced in rows, images and, the widths being close,
    text positions. Returns the micro-batches of every step in order (``len = steps x slots``).
    """
    least = min_step_rows(global_batch)
    if slots > least:
        raise UserError(f"{slots} micro-batches per step exceed the {least} rows a budget step may hold: use a "
                        f"data.micro_batch_size of at least {-(-global_batch // least)}")
    steps = pack(order, table, batch_size=global_batch, token_budget=token_budget, image_budget=image_budget,
                 rng=None, pad_multiple=pad_multiple, patch_budget=patch_budget)
    whole = [s for s in steps if len(s) >= least]
    left = [s for s in steps if len(s) < least]
    if left:
        rows = np.concatenate(left)
        rows = rows[np.argsort(_widths(table.text_len[rows], pad_multiple), kind="stable")]
        whole += _pack_sorted(rows, table.text_len[rows], _costs(table, rows, image_budget, patch_budget),
                              global_batch, token_budget, pad_multiple)
        whole = _balance_last(whole, table, least, pad_multiple)
    if rng is not None:
        whole = [whole[i] for i in rng.permutation(len(whole))]
    return [part for step in whole for part in np.array_split(step, slots)]
