"""Which samples an epoch holds: all rows once, or a weighted draw from several sources.

With source weights an epoch is a number of samples (``epoch_size``) split between the sources
by weight, so a small text-only corpus mixed into a large image-text set neither ends the epoch
early nor gets drowned. Each source is read as an endless stream of reshuffled passes over its
rows, and epoch ``e`` takes the next ``quota`` samples of that stream: a down-weighted source is
still covered in full over several epochs, and an up-weighted one repeats only after a full pass.
"""

from __future__ import annotations

import numpy as np

from vltrain.errors import UserError

# Distinct streams of randomness drawn from the same (seed, epoch).
_TAG_ORDER = 0
_TAG_SOURCE = 1


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
    for s, w in enumerate(weights):
        if w > 0 and not np.any(source == s):
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
