"""A weighted mixture under the windowed shuffle: exact quotas, full passes, every sampler promise."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from kits.sampler_fixtures import TableDataset, collate, shapes_lengths, table

from vltrain.data.loading.audit import AuditLog, audit_run
from vltrain.data.loading.loader import TrainLoader
from vltrain.data.schedule import budget
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.data.table import SampleTable
from vltrain.errors import UserError

SIZES = (120, 45)
BLOCK = 10
UP = dict(source_weights=[1.0, 3.0], epoch_size=96)  # quotas 24 and 72: the small source repeats in every epoch
DOWN = dict(source_weights=[2.0, 1.0], epoch_size=60)  # quotas 40 and 20: no quota exceeds its source


def mixture_table(sizes=SIZES, block=BLOCK):
    n = sum(sizes)
    t = table(shapes_lengths(n), source=np.repeat(np.arange(len(sizes)), sizes))
    t.blocks = np.unique(np.r_[np.arange(0, n, block), np.cumsum([0, *sizes])])
    return t


def samplers(t, world, mix, **kw):
    kw = {"batch_size": 4, "seed": 2, "window": 2, "token_budget": 64, "image_budget": 4, **mix, **kw}
    return [DistributedBatchSampler(t, Schedule(**kw), rank=r, world_size=world) for r in range(world)]


def epoch(ss, e):
    """All ranks' rows of epoch ``e`` in schedule order (step, then rank), and their repeat marks."""
    plans = [s.plan(e) for s in ss]
    assert len({len(p) for p in plans}) == 1  # equal steps on every rank
    rows = [p.batches[k] for k in range(len(plans[0])) for p in plans]
    marks = [p.repeats[k] for k in range(len(plans[0])) for p in plans]
    return np.concatenate(rows), np.concatenate(marks), plans[0]


def source_of(rows):
    return (np.asarray(rows) >= SIZES[0]).astype(int)


@pytest.mark.parametrize("batching", ["fixed", "budget"])
@pytest.mark.parametrize("mix", [UP, DOWN], ids=["up", "down"])
def test_each_epoch_takes_exact_quotas_and_reads_each_source_in_full_passes(batching, mix):
    (s,) = samplers(mixture_table(), 1, mix, batching=batching)
    quotas = [24, 72] if mix is UP else [40, 20]
    drawn = [Counter() for _ in SIZES]
    for e in range(7):
        rows, marks, plan = epoch([s], e)
        assert plan.padded == plan.dropped == 0
        for src, (q, m) in enumerate(zip(quotas, SIZES)):
            mine = rows[source_of(rows) == src]
            assert len(mine) == q
            # a row comes twice in an epoch only where its quota runs into the source's next pass
            within_one_pass = (e * q) // m == ((e + 1) * q - 1) // m
            if within_one_pass:
                assert len(set(mine.tolist())) == q
            drawn[src].update(mine.tolist())
            # after every epoch each row of the source was drawn c or c + 1 times: full passes first
            counts = [drawn[src][i] for i in range(sum(SIZES[:src]), sum(SIZES[: src + 1]))]
            assert max(counts) - min(counts) <= 1 and sum(counts) == (e + 1) * q


@pytest.mark.parametrize("batching", ["fixed", "budget"])
@pytest.mark.parametrize("world,remainder", [(1, "pad"), (2, "pad"), (3, "pad"), (2, "drop"), (3, "drop")])
def test_ranks_disjoint_and_repeats_marked_at_their_later_occurrences(batching, world, remainder):
    ss = samplers(mixture_table(), world, UP, batching=batching, remainder=remainder, batch_size=5)
    for e in range(3):
        rows, marks, plan = epoch(ss, e)
        later = np.ones(len(rows), dtype=bool)
        later[np.unique(rows, return_index=True)[1]] = False
        assert np.array_equal(marks, later)  # exactly every occurrence after a sample's first
        assert plan.distinct == len(set(rows.tolist()))
        assert len(rows) == 96 - plan.dropped + plan.padded


@pytest.mark.parametrize("batching", ["fixed", "budget"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_union_of_all_ranks_batches_is_the_epoch(batching, world):
    t = mixture_table()
    (one,) = samplers(t, 1, UP, batch_size=1)
    ss = samplers(t, world, UP, batching=batching, batch_size=8 // world)
    for e in range(3):
        rows, _, plan = epoch(ss, e)
        reference = Counter(epoch([one], e)[0].tolist())  # the epoch, one sample per batch
        assert not reference - Counter(rows.tolist())  # nothing left out (remainder=pad)
        padding = Counter(rows.tolist()) - reference  # rows repeated to equalize steps
        assert sum(padding.values()) == plan.padded and set(padding) <= set(reference)
        if batching == "fixed":
            assert padding == Counter(epoch([one], e)[0][: plan.padded].tolist())  # the epoch's first samples
        else:
            for b in (s.plan(e).batches[k] for s in ss for k in range(len(plan))):
                assert budget.batch_tokens(t.text_len[b]) <= 64 and len(b) <= 8 // world


@pytest.mark.parametrize("batching", ["fixed", "budget"])
def test_mixture_resumes_exactly(batching):
    t = mixture_table()
    a, = samplers(t, 2, UP, batching=batching)[1:]
    a.set_epoch(2)
    whole, marks = list(a), [a.plan().repeats[k] for k in range(len(a))]
    a.mark_consumed(5)
    b, = samplers(t, 2, UP, batching=batching)[1:]
    b.load_state_dict(a.state_dict())
    assert list(b) == whole[5:]
    assert all(np.array_equal(b.plan().repeats[k], marks[k]) for k in range(5, len(whole)))


@pytest.mark.parametrize("batching", ["fixed", "budget"])
def test_audit_passes_over_epochs_of_a_mixture(tmp_path, batching):
    t = mixture_table()
    for rank in range(2):
        (s,) = samplers(t, 2, UP, batching=batching)[rank:rank + 1]
        loader = TrainLoader(TableDataset(t), s, collate=collate, audit=AuditLog(tmp_path, rank, 2))
        for _ in range(len(s.plan(0)) + len(s.plan(1)) + 3):  # two whole epochs and part of a third
            next(loader)
        loader.audit.close()
    report = audit_run(tmp_path)
    assert report.ok, report.problems
    assert report.complete_epochs == 2


def _largest_array(obj, seen: set) -> int:
    """Elements of the largest numpy array reachable from ``obj`` (the sample table left out)."""
    if id(obj) in seen or isinstance(obj, SampleTable):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.size
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dict__"):
        obj = list(vars(obj).values())
    if isinstance(obj, (list, tuple)):
        return max((_largest_array(x, seen) for x in obj), default=0)
    return 0


def test_a_two_million_row_mixture_holds_blocks_and_a_window_not_rows():
    n, small = 2_000_000, 500_000
    t = SampleTable(np.ones(n, bool), np.ones(n, bool), np.full(n, 20, np.uint16),
                    np.repeat(np.array([0, 1], np.int16), [n - small, small]), blocks=np.r_[np.arange(0, n, 1000), n])
    tracemalloc.start()
    try:
        schedule = Schedule(batch_size=64, seed=0, window=4, source_weights=[1.0, 3.0])
        s = DistributedBatchSampler(t, schedule, rank=1, world_size=4)
        it = iter(s)
        batches = [np.array(next(it)) for _ in range(40)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n  # a full order would be 8 bytes per row
    assert _largest_array(s, set()) <= 8_000  # a block order and a window of 4 blocks of 1,000 rows
    # each batch reads a few shards, and the small source gets its three quarters
    assert np.mean([len(np.unique(b // 1000)) for b in batches]) <= 4 + 2
    assert abs(np.mean(np.concatenate(batches) >= n - small) - 0.75) < 0.02


def test_a_resume_with_other_source_weights_is_refused():
    """The weights decide the schedule: resuming under others would silently change it."""
    t = mixture_table()
    (saved,) = samplers(t, 1, UP)
    saved.mark_consumed(3)
    (same,) = samplers(t, 1, UP)
    same.load_state_dict(saved.state_dict())
    assert same.consumed == 3
    for other in ({**UP, "source_weights": [1.0, 2.0]}, {**UP, "epoch_size": 80}):
        (s,) = samplers(t, 1, other)
        with pytest.raises(UserError, match="source_weights|epoch_size"):
            s.load_state_dict(saved.state_dict())
