"""A shuffle that reads a few shards at a time, and an epoch plan computed batch by batch.

A full permutation of a billion rows costs every rank 8 GB and sends every loader worker to a
random shard for every sample: with remote shards, a whole-shard download per sample. The
windowed shuffle is the usual answer (WebDataset's shard shuffle plus a sample buffer), made
exact and lazy:

- the epoch's **blocks** (a tar shard, or ``MANIFEST_BLOCK`` consecutive manifest rows) are put
  in a random order;
- consecutive runs of ``window`` blocks form a **window**, whose samples are shuffled fully;
- the epoch order is the windows one after another.

So position ``p`` of the epoch is found from the block order (one entry per block) and the one
window that holds it: a rank computes only the windows of its own batches, and memory is
O(blocks + one window), not O(samples). Batch-mates come from ``window`` blocks rather than from
the whole dataset; ``benchmarks/data_scale.py`` measures what that costs in mixing.

The batches below take any :class:`Windows`: a weighted mixture's order
(:class:`vltrain.data.schedule.mixing.MixedOrder`) is one too, its windows chunks that take each source's
share of the epoch from that source's own windowed passes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

_TAG_WINDOW = 3


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFF_FFFF, _TAG_WINDOW, *(int(k) for k in keys)])


def keep_two(cache: dict, key: int, value):
    """Remember ``value`` under ``key``, forgetting the oldest of two: the loader's and the look-ahead's."""
    if key not in cache and len(cache) >= 2:
        cache.pop(min(cache))
    cache[key] = value
    return value


def later_copies(rows: np.ndarray) -> np.ndarray:
    """Per row, whether the same value occurs at an earlier place of ``rows``."""
    copy = np.ones(len(rows), dtype=bool)
    copy[np.unique(rows, return_index=True)[1]] = False
    return copy


class Windows(ABC):
    """An epoch order cut into windows: ``window_starts`` (then the length), ``window_rows(w)``.

    ``earlier(w)`` says which rows of window ``w`` already occur in an earlier window, or None
    when no row of the window repeats one of the epoch (earlier or within it): the one order
    where samples repeat is a mixture whose quota runs into a source's next pass."""

    window_starts: np.ndarray

    def __len__(self) -> int:
        return int(self.window_starts[-1])

    @abstractmethod
    def window_rows(self, w: int) -> np.ndarray:
        """The rows of window ``w``, in the epoch's order."""

    def earlier(self, w: int) -> np.ndarray | None:
        return None

    def window_repeats(self, w: int) -> np.ndarray:
        """Per row of window ``w``, whether its sample occurs at an earlier position of the epoch."""
        seen = self.earlier(w)
        if seen is None:
            return np.zeros(int(self.window_starts[w + 1] - self.window_starts[w]), dtype=bool)
        return seen | later_copies(self.window_rows(w))

    def _walk(self, start: int, stop: int, per_window) -> list[np.ndarray]:
        parts = []
        w = int(np.searchsorted(self.window_starts, start, side="right")) - 1
        while start < stop:
            lo = int(self.window_starts[w])
            hi = min(stop, int(self.window_starts[w + 1]))
            if hi > start:
                parts.append(per_window(w)[start - lo : hi - lo])
                start = hi
            w += 1
        return parts

    def take(self, start: int, stop: int) -> np.ndarray:
        """Rows at positions ``start .. stop`` of the epoch (within ``0 .. len``)."""
        parts = self._walk(start, stop, self.window_rows)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def repeats(self, start: int, stop: int) -> np.ndarray:
        """Per position ``start .. stop``, whether its sample occurs at an earlier position."""
        parts = self._walk(start, stop, self.window_repeats)
        return np.concatenate(parts) if parts else np.empty(0, dtype=bool)

    def repeat_count(self, stop: int) -> int:
        """Positions before ``stop`` whose sample occurs at an earlier one (walks the windows)."""
        windows = range(int(np.searchsorted(self.window_starts, stop, side="left")))
        return sum(int(self.repeats(int(self.window_starts[w]), min(stop, int(self.window_starts[w + 1]))).sum())
                   for w in windows if self.earlier(w) is not None)

    def all(self) -> np.ndarray:
        return self.take(0, len(self))


class WindowedOrder(Windows):
    """The windowed-shuffle order of one epoch over ``blocks`` (block starts, then the row count).

    ``key`` tells apart orders drawn from one seed (a mixture's sources, each read pass by pass:
    ``epoch`` is then the pass)."""

    def __init__(self, blocks: np.ndarray, *, seed: int, epoch: int, window: int, shuffle: bool = True,
                 key: tuple[int, ...] = ()):
        self.blocks = np.asarray(blocks, dtype=np.int64)
        self.seed, self.epoch, self.window, self.shuffle = seed, epoch, max(1, int(window)), shuffle
        self.key = (*key, epoch)
        count = len(self.blocks) - 1
        self.block_order = _rng(seed, *self.key).permutation(count) if shuffle else np.arange(count)
        sizes = np.diff(self.blocks)[self.block_order]
        self.window_sizes = np.add.reduceat(sizes, np.arange(0, count, self.window)) if count else sizes
        self.window_starts = np.r_[0, np.cumsum(self.window_sizes)]
        self._cached: dict[int, np.ndarray] = {}
        self._slot: np.ndarray | None = None  # block -> its place in block_order, for holds()

    def window_rows(self, w: int) -> np.ndarray:
        """The rows of window ``w``, in the epoch's order."""
        if w in self._cached:
            return self._cached[w]
        picked = self.block_order[w * self.window : (w + 1) * self.window]
        rows = np.concatenate([np.arange(self.blocks[b], self.blocks[b + 1]) for b in picked]) \
            if len(picked) else np.empty(0, dtype=np.int64)
        if self.shuffle:
            rows = rows[_rng(self.seed, *self.key, w + 1).permutation(len(rows))]
        return keep_two(self._cached, w, rows)

    def repeat_count(self, stop: int) -> int:
        return 0  # a permutation

    def holds(self, rows: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Per row, whether it sits at a position in ``start .. stop`` of this order.

        A row's block gives its window; only the (at most two) windows cut by ``start`` or
        ``stop`` are drawn to find where in them a row sits."""
        if self._slot is None:
            self._slot = np.empty(len(self.block_order), dtype=np.int64)
            self._slot[self.block_order] = np.arange(len(self.block_order))
        w = self._slot[np.searchsorted(self.blocks, rows, side="right") - 1] // self.window
        lo, hi = self.window_starts[w], self.window_starts[w + 1]
        inside = (lo >= start) & (hi <= stop)
        cut = (lo < stop) & (hi > start) & ~inside
        for e in np.unique(w[cut]).tolist():
            mine = cut & (w == e)
            window = self.window_rows(e)
            at = np.argsort(window)
            pos = self.window_starts[e] + at[np.searchsorted(window[at], rows[mine])]
            inside[mine] = (pos >= start) & (pos < stop)
        return inside


class LazyBatches:
    """A read-only sequence of one rank's fixed-size batches, each computed when asked for."""

    def __init__(self, order: Windows, *, rank: int, world_size: int, batch_size: int, steps: int):
        self.order, self.rank, self.world, self.b, self.steps = order, rank, world_size, batch_size, steps

    def __len__(self) -> int:
        return self.steps

    def positions(self, k: int) -> tuple[int, int]:
        g = k * self.world + self.rank
        return g * self.b, (g + 1) * self.b

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self.steps))]
        if not -self.steps <= k < self.steps:
            raise IndexError(k)
        lo, hi = self.positions(k % self.steps)
        n = len(self.order)
        if hi <= n:
            return self.order.take(lo, hi)
        # past the end: the epoch's first samples again (remainder=pad), as np.resize repeats them
        if lo >= n or hi - n > n:
            return self.order.all()[np.arange(lo, hi) % n]  # tiny epochs only
        return np.concatenate([self.order.take(lo, n), self.order.take(0, hi - n)])

    def repeats(self, k: int) -> np.ndarray:
        lo, hi = self.positions(k)
        n = len(self.order)
        out = np.arange(lo, hi) >= n
        if lo < n:
            out[: min(hi, n) - lo] |= self.order.repeats(lo, min(hi, n))
        return out

    def has(self, k: int) -> bool:
        return 0 <= k < self.steps

    def __iter__(self):
        return (self[k] for k in range(self.steps))


class LazyRepeats:
    """Per batch of a lazy plan, which rows repeat an earlier sample of the epoch."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> np.ndarray:
        return self.batches.repeats(k)


class LazyBudgetBatches:
    """One rank's budget batches over the windowed order, packed window by window when asked for.

    Each window's rows are packed on their own (``budget.pack``), its batches split until their
    count divides by the world size (``budget.split_to_multiple``; ``remainder`` pads or drops
    only a window too small to split), and dealt round robin: step ``s`` of the window gives rank
    ``r`` its batch ``s * world + r``. So every rank steps through the same windows at the same
    steps, and reaching step ``k`` packs only the windows before it. ``len`` packs them all once.
    A row repeats an earlier sample if the order says it occurs in an earlier window, or if it
    occurs in an earlier batch of its window (a padding batch, or a mixture's second pass).
    """

    def __init__(self, order: Windows, pack, *, rank: int, world_size: int, remainder: str):
        self.order, self.pack, self.rank, self.world, self.remainder = order, pack, rank, world_size, remainder
        self.ends: list[int] = []  # steps up to the end of each packed window
        self.dropped, self.padded, self.repeated = 0, 0, 0  # over the windows packed so far
        # batches, first padding batch, and per row of the batches laid end to end whether it repeats
        # (None: only padding batches do)
        self._windows: dict[int, tuple[list[np.ndarray], int, np.ndarray | None]] = {}

    def _window(self, w: int) -> tuple[list[np.ndarray], int, np.ndarray | None]:
        if w not in self._windows:
            batches = self.pack(self.order.window_rows(w), w)
            real, dropped = len(batches), 0
            extra = -len(batches) % self.world
            if extra and self.remainder == "drop":
                real = len(batches) - len(batches) % self.world
                dropped, batches = sum(len(b) for b in batches[real:]), batches[:real]
            elif extra:
                batches = batches + [batches[i % len(batches)] for i in range(extra)]
            marks = self._marks(w, batches)
            keep_two(self._windows, w, (batches, real, marks))
            if w == len(self.ends):  # first time through: count it
                self.ends.append((self.ends[-1] if self.ends else 0) + len(batches) // self.world)
                self.dropped += dropped
                self.padded += sum(len(b) for b in batches[real:])
                if marks is not None:
                    self.repeated += int(marks[: sum(len(b) for b in batches[:real])].sum())
        return self._windows[w]

    def _marks(self, w: int, batches: list[np.ndarray]) -> np.ndarray | None:
        seen = self.order.earlier(w)
        if seen is None:
            return None
        flat = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        return np.isin(flat, self.order.window_rows(w)[seen]) | later_copies(flat)

    def _locate(self, k: int) -> tuple[int, int] | None:
        """(window, step within it) of step ``k``; None past the epoch's end."""
        windows = len(self.order.window_sizes)
        while (not self.ends or self.ends[-1] <= k) and len(self.ends) < windows:
            self._window(len(self.ends))
        w = int(np.searchsorted(self.ends, k, side="right"))
        if w >= len(self.ends):
            return None
        return w, k - (self.ends[w - 1] if w else 0)

    def has(self, k: int) -> bool:
        return k >= 0 and self._locate(k) is not None

    def __len__(self) -> int:
        self._locate(1 << 62)
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        where = self._locate(k if k >= 0 else len(self) + k)
        if where is None:
            raise IndexError(k)
        batches, _, _ = self._window(where[0])
        return batches[where[1] * self.world + self.rank]

    def repeats(self, k: int) -> np.ndarray:
        w, s = self._locate(k)
        batches, real, marks = self._window(w)
        i = s * self.world + self.rank
        if marks is None:
            return np.full(len(batches[i]), i >= real, dtype=bool)
        start = sum(len(b) for b in batches[:i])
        return marks[start : start + len(batches[i])]

    def __iter__(self):
        k = 0
        while self.has(k):
            yield self[k]
            k += 1
