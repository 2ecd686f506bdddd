"""Which samples an epoch holds: all rows once, or a weighted draw from several sources.

With source weights an epoch is a number of samples (``epoch_size``) split between the sources
by weight, so a small text-only corpus mixed into a large image-text set neither ends the epoch
early nor gets drowned. Each source is read as an endless stream of reshuffled passes over its
rows, and epoch ``e`` takes the next ``quota`` samples of that stream: a down-weighted source is
still covered in full over several epochs, and an up-weighted one repeats only after a full pass.
An epoch whose quota runs from one pass into the next can meet a row twice; the later one counts
as a repeat (the audit's planned repeats).

Without a window (``epoch_order``) the passes are permutations and the epoch is one permutation of
the sources' draws. With a window (:class:`Mixture`) the order is lazy, as for one source
(:mod:`vltrain.data.schedule.window`): a pass is the windowed order of the source's own blocks, and the
epoch is cut into chunks that each take every source's share and are shuffled, so a rank holds
the block orders and a chunk or two, not a row per sample.
"""

from __future__ import annotations

import numpy as np

from vltrain.data.schedule.window import WindowedOrder, Windows, keep_two
from vltrain.data.table import default_blocks
from vltrain.errors import UserError

# Distinct streams of randomness drawn from the same (seed, epoch); the sampler's batches take 2,
# the windowed shuffle 3.
_TAG_ORDER = 0
_TAG_SOURCE = 1
_TAG_CHUNK = 4


def rng_for(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on its keys, so every rank derives the same one."""
    return np.random.default_rng([int(seed) & 0xFFFF_FFFF, *(int(k) for k in keys)])


def source_quotas(weights: list[float], epoch_size: int) -> np.ndarray:
    """Samples per source in one epoch: ``epoch_size`` split by weight, largest remainders first."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum() * epoch_size
    quotas = np.floor(share).astype(np.int64)
    short = epoch_size - int(quotas.sum())
    if short:
        order = np.argsort(-(share - quotas), kind="stable")
        quotas[order[:short]] += 1
    return quotas


def _stream(rows: np.ndarray, start: int, count: int, seed: int, source: int, shuffle: bool) -> np.ndarray:
    """Positions ``start .. start+count`` of the endless sequence of passes over ``rows``."""
    m = len(rows)
    out = np.empty(count, dtype=np.int64)
    pos, filled = start, 0
    while filled < count:
        cycle, offset = divmod(pos, m)
        perm = rng_for(seed, _TAG_SOURCE, source, cycle).permutation(m) if shuffle else np.arange(m)
        take = min(m - offset, count - filled)
        out[filled : filled + take] = rows[perm[offset : offset + take]]
        filled += take
        pos += take
    return out


def check_weights(source: np.ndarray, weights: list[float]) -> None:
    num_sources = int(source.max()) + 1 if len(source) else 0
    if len(weights) != num_sources:
        raise UserError(f"{len(weights)} source weights given for {num_sources} sources; give one weight per source")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"source weights must be >= 0 with a positive sum, got {weights}")
    present = set(source_runs(source)[1].tolist()) if len(source) else set()
    for s, w in enumerate(weights):
        if w > 0 and s not in present:
            raise UserError(f"source {s} has weight {w} but no rows; remove it or fix its path")


def epoch_order(
    source: np.ndarray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    weights: list[float] | None = None,
    epoch_size: int | None = None,
) -> np.ndarray:
    """Dataset indices of one epoch, in the order they are batched (before any padding or drop)."""
    n = len(source)
    if weights is None:
        return rng_for(seed, _TAG_ORDER, epoch).permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    size = n if epoch_size is None else int(epoch_size)
    quotas = source_quotas(weights, size)
    parts = []
    for s, q in enumerate(quotas):
        if q:
            rows = np.flatnonzero(source == s)
            parts.append(_stream(rows, epoch * int(q), int(q), seed, s, shuffle))
    order = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return rng_for(seed, _TAG_ORDER, epoch).permutation(order) if shuffle else order


def source_runs(source: np.ndarray, chunk: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of one source id starts (then the row count), and the run's id.

    A dataset lays its sources out one after the other (one run each), but nothing in a sample
    table promises it; the column is read ``chunk`` rows at a time, so no per-row array is made."""
    n = len(source)
    cuts = [np.zeros(1, dtype=np.int64)]
    for lo in range(0, n - 1, chunk):
        part = np.asarray(source[lo : lo + chunk + 1])
        cuts.append(np.flatnonzero(part[1:] != part[:-1]) + lo + 1)
    starts = np.concatenate(cuts)
    return np.r_[starts, n], np.asarray(source[starts], dtype=np.int64)


def _own_blocks(blocks: np.ndarray | None, starts: np.ndarray, stops: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A source's block starts (then its size) in its own row numbers: the table's blocks within
    its runs, and a break wherever a run starts."""
    if blocks is None:
        return default_blocks(int(offsets[-1]))
    parts = [o + np.r_[0, blocks[np.searchsorted(blocks, a, "right") : np.searchsorted(blocks, b, "left")] - a]
             for a, b, o in zip(starts.tolist(), stops.tolist(), offsets.tolist())]
    return np.r_[np.concatenate(parts), offsets[-1]].astype(np.int64)


class SourceStream:
    """One source of a mixture as an endless stream of passes, in its own row numbers ``0..size``.

    Pass ``c`` is the windowed order of the source's blocks drawn for (source, ``c``): every row
    once per pass, read ``window`` blocks at a time."""

    def __init__(self, starts: np.ndarray, stops: np.ndarray, blocks: np.ndarray | None, *, index: int,
                 seed: int, window: int, shuffle: bool):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.offsets = np.r_[0, np.cumsum(np.asarray(stops, dtype=np.int64) - self.starts)]
        self.size = int(self.offsets[-1])
        self.blocks = _own_blocks(blocks, self.starts, np.asarray(stops), self.offsets)
        self.index, self.seed, self.window, self.shuffle = index, seed, window, shuffle
        self._passes: dict[int, WindowedOrder] = {}

    def _pass(self, c: int) -> WindowedOrder:
        if c in self._passes:
            return self._passes[c]
        order = WindowedOrder(self.blocks, seed=self.seed, epoch=c, window=self.window, shuffle=self.shuffle,
                              key=(self.index,))
        return keep_two(self._passes, c, order)

    def _spans(self, start: int, stop: int):
        """(pass, first, last) of each pass that stream positions ``start .. stop`` cross."""
        while start < stop:
            c, at = divmod(start, self.size)
            n = min(stop - start, self.size - at)
            yield c, at, at + n
            start += n

    def take(self, start: int, stop: int) -> np.ndarray:
        """The source's rows at stream positions ``start .. stop``."""
        parts = [self._pass(c).take(lo, hi) for c, lo, hi in self._spans(start, stop)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def seen(self, rows: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Per row (the source's own numbering), whether it occurs at a stream position in ``start .. stop``."""
        out = np.zeros(len(rows), dtype=bool)
        for c, lo, hi in self._spans(start, stop):
            if hi - lo == self.size:  # a whole pass
                return np.ones(len(rows), dtype=bool)
            out |= self._pass(c).holds(rows, lo, hi)
        return out

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """Dataset indices of the source's rows."""
        run = np.searchsorted(self.offsets, rows, side="right") - 1
        return self.starts[run] + (rows - self.offsets[run])


class MixedOrder(Windows):
    """One epoch of a weighted mixture: chunks that each take every source's share, shuffled.

    Chunk ``k`` ends at epoch position ``min((k + 1) x chunk, L)`` and holds source ``s``'s stream
    up to ``floor(q_s x end / L)`` samples past the epoch's first, ``q_s`` its quota and ``L`` their
    sum. So each source gives exactly its quota, and at every chunk's end its share to within one
    sample. Position ``p`` is found from those counts (a row per chunk) and the chunk that holds it.
    """

    def __init__(self, streams: list[SourceStream | None], quotas: np.ndarray, *, seed: int, epoch: int,
                 chunk: int, shuffle: bool):
        self.streams, self.seed, self.epoch, self.shuffle = streams, seed, epoch, shuffle
        quotas = np.asarray(quotas, dtype=np.int64)
        total = int(quotas.sum())
        ends = np.r_[0, np.minimum(np.arange(1, -(-total // chunk) + 1) * chunk, total)]
        # exact in Python integers: q x end overflows int64 past 3 billion samples an epoch
        self.taken = (quotas.astype(object)[None, :] * ends.astype(object)[:, None] // max(total, 1)).astype(np.int64)
        self.first = quotas * int(epoch)  # each source's stream position where the epoch starts
        self.window_starts = self.taken.sum(axis=1)
        self.window_sizes = np.diff(self.window_starts)
        self._cached: dict[int, np.ndarray] = {}
        self._earlier: dict[int, np.ndarray | None] = {}

    def _draw(self, w: int) -> tuple[list[np.ndarray | None], np.ndarray | None]:
        """Each source's part of chunk ``w`` (in the source's own numbering), and the chunk's shuffle."""
        parts = [x.take(f + lo, f + hi) if x is not None else None
                 for x, f, lo, hi in zip(self.streams, self.first, self.taken[w], self.taken[w + 1])]
        size = int(self.window_sizes[w])
        return parts, rng_for(self.seed, _TAG_CHUNK, self.epoch, w).permutation(size) if self.shuffle else None

    def window_rows(self, w: int) -> np.ndarray:
        if w in self._cached:
            return self._cached[w]
        parts, perm = self._draw(w)
        mine = [x.table_rows(p) for x, p in zip(self.streams, parts) if x is not None]
        rows = np.concatenate(mine) if mine else np.empty(0, dtype=np.int64)
        return keep_two(self._cached, w, rows if perm is None else rows[perm])

    def _crossing(self, w: int) -> list[bool]:
        """Per source: its part of chunk ``w`` may meet a row of the epoch twice (the epoch's
        stream so far reaches into a second pass)."""
        return [x is not None and hi > lo and (f // x.size) != (f + hi - 1) // x.size
                for x, f, lo, hi in zip(self.streams, self.first, self.taken[w], self.taken[w + 1])]

    def earlier(self, w: int) -> np.ndarray | None:
        if w in self._earlier:
            return self._earlier[w]
        crossing = self._crossing(w)
        if not any(crossing):
            return keep_two(self._earlier, w, None)
        parts, perm = self._draw(w)
        seen = [x.seen(p, f, f + lo) if cross else np.zeros(len(p), dtype=bool)
                for x, p, f, lo, cross in zip(self.streams, parts, self.first, self.taken[w], crossing)
                if x is not None]
        seen = np.concatenate(seen)
        return keep_two(self._earlier, w, seen if perm is None else seen[perm])


class Mixture:
    """The sources of a weighted mixture as streams, for the windowed shuffle: found once (a
    pass over the source column), then an epoch's :class:`MixedOrder` costs O(blocks).

    Each source's passes read ``window`` blocks at a time in proportion to its quota (at least
    one), and a chunk holds about ``window`` blocks' rows: a chunk is fed by about ``window``
    shards, as one window of a single source is."""

    def __init__(self, source: np.ndarray, blocks: np.ndarray | None, weights: list[float],
                 epoch_size: int | None, *, seed: int, window: int, shuffle: bool):
        size = len(source) if epoch_size is None else int(epoch_size)
        self.quotas = source_quotas(weights, size)
        bounds, ids = source_runs(source)
        blocks = None if blocks is None else np.asarray(blocks, dtype=np.int64)
        self.streams = [
            SourceStream(bounds[:-1][ids == s], bounds[1:][ids == s], blocks, index=s, seed=seed,
                         window=max(1, round(window * int(q) / size)), shuffle=shuffle) if q else None
            for s, q in enumerate(self.quotas)
        ]
        used = [x for x in self.streams if x is not None]
        rows, count = sum(x.size for x in used), sum(len(x.blocks) - 1 for x in used)
        self.chunk = max(1, round(window * rows / max(count, 1)))
        self.seed, self.shuffle = seed, shuffle

    def order(self, epoch: int) -> MixedOrder:
        return MixedOrder(self.streams, self.quotas, seed=self.seed, epoch=epoch, chunk=self.chunk,
                          shuffle=self.shuffle)
