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
"""

from __future__ import annotations

import numpy as np

MANIFEST_BLOCK = 4096
"""Rows of a manifest that count as one block of the windowed shuffle."""
_TAG_WINDOW = 3


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFF_FFFF, _TAG_WINDOW, *(int(k) for k in keys)])


class WindowedOrder:
    """The windowed-shuffle order of one epoch over ``blocks`` (block starts, then the row count)."""

    def __init__(self, blocks: np.ndarray, *, seed: int, epoch: int, window: int, shuffle: bool = True):
        self.blocks = np.asarray(blocks, dtype=np.int64)
        self.seed, self.epoch, self.window, self.shuffle = seed, epoch, max(1, int(window)), shuffle
        count = len(self.blocks) - 1
        self.block_order = _rng(seed, epoch).permutation(count) if shuffle else np.arange(count)
        sizes = np.diff(self.blocks)[self.block_order]
        self.window_sizes = np.add.reduceat(sizes, np.arange(0, count, self.window)) if count else sizes
        self.window_starts = np.r_[0, np.cumsum(self.window_sizes)]
        self._cached: dict[int, np.ndarray] = {}  # two windows: the loader's and the look-ahead's

    def __len__(self) -> int:
        return int(self.window_starts[-1])

    def window_rows(self, w: int) -> np.ndarray:
        """The rows of window ``w``, in the epoch's order."""
        if w in self._cached:
            return self._cached[w]
        picked = self.block_order[w * self.window : (w + 1) * self.window]
        rows = np.concatenate([np.arange(self.blocks[b], self.blocks[b + 1]) for b in picked]) \
            if len(picked) else np.empty(0, dtype=np.int64)
        if self.shuffle:
            rows = rows[_rng(self.seed, self.epoch, w + 1).permutation(len(rows))]
        if len(self._cached) >= 2:
            self._cached.pop(min(self._cached))
        self._cached[w] = rows
        return rows

    def take(self, start: int, stop: int) -> np.ndarray:
        """Rows at positions ``start .. stop`` of the epoch (within ``0 .. len``)."""
        parts = []
        w = int(np.searchsorted(self.window_starts, start, side="right")) - 1
        while start < stop:
            lo = int(self.window_starts[w])
            hi = min(stop, int(self.window_starts[w + 1]))
            if hi > start:
                parts.append(self.window_rows(w)[start - lo : hi - lo])
                start = hi
            w += 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def all(self) -> np.ndarray:
        return self.take(0, len(self))


class LazyBatches:
    """A read-only sequence of one rank's fixed-size batches, each computed when asked for."""

    def __init__(self, order: WindowedOrder, *, rank: int, world_size: int, batch_size: int, steps: int):
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
        return np.arange(lo, hi) >= len(self.order)

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


def default_blocks(n: int) -> np.ndarray:
    """Block starts (then ``n``) of a source without shards: runs of ``MANIFEST_BLOCK`` rows."""
    return np.r_[np.arange(0, n, MANIFEST_BLOCK, dtype=np.int64), n]


class LazyBudgetBatches:
    """One rank's budget batches over the windowed order, packed window by window when asked for.

    Each window's rows are packed on their own (``budget.pack``), its batches split until their
    count divides by the world size (``budget.split_to_multiple``; ``remainder`` pads or drops
    only a window too small to split), and dealt round robin: step ``s`` of the window gives rank
    ``r`` its batch ``s * world + r``. So every rank steps through the same windows at the same
    steps, and reaching step ``k`` packs only the windows before it. ``len`` packs them all once.
    """

    def __init__(self, order: WindowedOrder, pack, *, rank: int, world_size: int, remainder: str):
        self.order, self.pack, self.rank, self.world, self.remainder = order, pack, rank, world_size, remainder
        self.ends: list[int] = []  # steps up to the end of each packed window
        self.dropped, self.padded = 0, 0  # over the windows packed so far
        self._windows: dict[int, tuple[list[np.ndarray], int]] = {}  # batches, first padding batch

    def _window(self, w: int) -> tuple[list[np.ndarray], int]:
        if w not in self._windows:
            batches = self.pack(self.order.window_rows(w), w)
            real, dropped = len(batches), 0
            extra = -len(batches) % self.world
            if extra and self.remainder == "drop":
                real = len(batches) - len(batches) % self.world
                dropped, batches = sum(len(b) for b in batches[real:]), batches[:real]
            elif extra:
                batches = batches + [batches[i % len(batches)] for i in range(extra)]
            if len(self._windows) >= 2:
                self._windows.pop(min(self._windows))
            self._windows[w] = (batches, real)
            if w == len(self.ends):  # first time through: count it
                self.ends.append((self.ends[-1] if self.ends else 0) + len(batches) // self.world)
                self.dropped += dropped
                self.padded += sum(len(b) for b in batches[real:])
        return self._windows[w]

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
        batches, _ = self._window(where[0])
        return batches[where[1] * self.world + self.rank]

    def repeats(self, k: int) -> np.ndarray:
        w, s = self._locate(k)
        batches, real = self._window(w)
        i = s * self.world + self.rank
        return np.full(len(batches[i]), i >= real, dtype=bool)

    def __iter__(self):
        k = 0
        while self.has(k):
            yield self[k]
            k += 1
