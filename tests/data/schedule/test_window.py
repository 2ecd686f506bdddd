"""The windowed shuffle and the lazy epoch plan: every promise of the full-permutation sampler."""

from __future__ import annotations

import numpy as np
import pytest
from kits.sampler_fixtures import TableDataset, collate, shapes_lengths, table

from vltrain.data.loading.audit import AuditLog, audit_run
from vltrain.data.loading.loader import TrainLoader
from vltrain.data.schedule import budget
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.data.schedule.window import WindowedOrder

N = 103


def blocked_table(n=N, block=10):
    t = table(shapes_lengths(n))
    t.blocks = np.r_[np.arange(0, n, block), n]
    return t


def test_windowed_order_is_a_permutation_reading_few_blocks_at_a_time():
    blocks = np.r_[np.arange(0, N, 10), N]
    windowed = WindowedOrder(blocks, seed=3, epoch=1, window=2)
    order = windowed.all()
    assert sorted(order.tolist()) == list(range(N))
    spans = np.diff(windowed.window_starts)
    assert len(spans) == 6 and np.array_equal(np.concatenate([windowed.window_rows(w) for w in range(6)]), order)
    for w in range(6):  # a window reads two blocks, and mixes them
        rows = windowed.window_rows(w)
        assert len(np.unique(rows // 10)) <= 2
        assert not np.array_equal(rows, np.sort(rows))
    again = WindowedOrder(blocks, seed=3, epoch=1, window=2)
    assert np.array_equal(again.take(17, 61), order[17:61])
    other = WindowedOrder(blocks, seed=3, epoch=2, window=2).all()
    assert not np.array_equal(order, other)


@pytest.mark.parametrize("world,remainder", [(1, "pad"), (2, "pad"), (3, "drop"), (2, "drop")])
def test_lazy_fixed_plan_equal_steps_disjoint_and_complete(world, remainder):
    t = blocked_table()
    schedule = Schedule(batch_size=4, seed=0, remainder=remainder, window=3)
    samplers = [DistributedBatchSampler(t, schedule, rank=r, world_size=world) for r in range(world)]
    plans = [s.plan(epoch=1) for s in samplers]
    assert len({len(p) for p in plans}) == 1
    rows, repeated = [], []
    for p in plans:
        for k in range(len(p)):
            assert len(p.batches[k]) == 4
            rows += p.batches[k][~p.repeats[k]].tolist()
            repeated += p.batches[k][p.repeats[k]].tolist()
    assert len(rows) == len(set(rows)) == plans[0].distinct
    assert plans[0].distinct + plans[0].dropped == N
    assert len(repeated) == plans[0].padded and set(repeated) <= set(rows)
    # the lazy batches are the windowed order cut into world x batch steps, as the full plan cuts its order
    order = WindowedOrder(t.blocks, seed=0, epoch=1, window=3).all()
    order = np.resize(order, len(plans[0]) * world * 4)
    for r, p in enumerate(plans):
        for k in range(len(p)):
            g = k * world + r
            assert p.batches[k].tolist() == order[g * 4 : (g + 1) * 4].tolist()


def test_lazy_plan_resumes_exactly():
    t = blocked_table()
    a = DistributedBatchSampler(t, Schedule(batch_size=4, seed=5, window=2), rank=1, world_size=2)
    whole = list(a)
    a.mark_consumed(5)
    b = DistributedBatchSampler(t, Schedule(batch_size=4, seed=5, window=2), rank=1, world_size=2)
    b.load_state_dict(a.state_dict())
    assert list(b) == whole[5:]
    c = DistributedBatchSampler(t, Schedule(batch_size=4, seed=5, window=0), rank=1, world_size=2)
    with pytest.raises(Exception, match="shuffle_window"):
        c.load_state_dict(a.state_dict())


@pytest.mark.parametrize("world,remainder", [(2, "pad"), (3, "pad"), (3, "drop")])
def test_lazy_budget_plan_equal_steps_within_budget_each_row_once(world, remainder):
    t = blocked_table(N, 7)
    schedule = Schedule(batch_size=8, seed=0, batching="budget", token_budget=96, image_budget=8, window=2,
                        remainder=remainder)
    samplers = [DistributedBatchSampler(t, schedule, rank=r, world_size=world)
                for r in range(world)]
    plans = [s.plan() for s in samplers]
    assert len({len(p) for p in plans}) == 1
    first, repeated = [], []
    for p in plans:
        for k in range(len(p)):
            b = p.batches[k]
            assert budget.batch_tokens(t.text_len[b]) <= 96 and len(b) <= 8
            first += b[~p.repeats[k]].tolist()
            repeated += b[p.repeats[k]].tolist()
            # one window at a time: a batch's rows come from the two shards of its window
            assert len(np.unique(b // 7)) <= 2
    assert len(first) == len(set(first)) == plans[0].distinct
    assert plans[0].distinct + plans[0].dropped == N and len(repeated) == plans[0].padded
    assert set(repeated) <= set(first)


@pytest.mark.parametrize("full_shuffle", [False, True])
def test_global_budget_steps_are_the_same_on_any_split(full_shuffle):
    """data.global_batch_size with budget batching: each step's rows are decided for the world,
    lazily window by window or for the whole epoch, then dealt to W ranks x A micro-batches."""
    t = blocked_table(400, 40)
    steps = {}
    for world, micro in [(1, 16), (1, 8), (2, 8), (4, 4)]:
        accumulation = 16 // (world * micro)
        schedule = Schedule(batch_size=micro, seed=1, batching="budget", token_budget=16 * 24, image_budget=16,
                            window=0 if full_shuffle else 3, global_batch=16)
        plans = [DistributedBatchSampler(t, schedule, rank=r, world_size=world).plan(1) for r in range(world)]
        assert len({len(p) for p in plans}) == 1 and len(plans[0]) % accumulation == 0
        per_step = []
        for s in range(len(plans[0]) // accumulation):
            batches = [p.batches[s * accumulation + i] for p in plans for i in range(accumulation)]
            assert all(1 <= len(b) <= micro for b in batches)
            rows = np.concatenate(batches)
            assert 4 <= len(rows) <= 16 and budget.batch_tokens(t.text_len[rows]) <= 16 * 24
            per_step.append(sorted(rows.tolist()))
        assert sorted(r for step in per_step for r in step) == list(range(400))
        steps[(world, micro)] = per_step
    first = steps[(1, 16)]
    assert all(v == first for v in steps.values())


def test_lazy_budget_plan_resumes_exactly_packing_only_what_it_reaches():
    t = blocked_table(N, 7)
    schedule = Schedule(batch_size=8, seed=4, batching="budget", token_budget=96, image_budget=8, window=3)
    a = DistributedBatchSampler(t, schedule, rank=0, world_size=2)
    whole = list(a)
    a.mark_consumed(4)
    b = DistributedBatchSampler(t, schedule, rank=0, world_size=2)
    b.load_state_dict(a.state_dict())
    it = iter(b)
    assert next(it) == whole[4]
    assert len(b.plan().batches.ends) < len(b.plan().batches.order.window_sizes)  # not every window packed
    assert [whole[4], *it] == whole[4:]


@pytest.mark.parametrize("batching", ["fixed", "budget"])
def test_audit_passes_over_epochs_of_the_lazy_plan(tmp_path, batching):
    t = blocked_table()
    for rank in range(2):
        schedule = Schedule(batch_size=4, seed=0, window=2, batching=batching, token_budget=64, image_budget=4)
        s = DistributedBatchSampler(t, schedule, rank=rank, world_size=2)
        loader = TrainLoader(TableDataset(t), s, collate=collate, audit=AuditLog(tmp_path, rank, 2))
        steps = len(s.plan(epoch=0))
        for _ in range(2 * steps + 3):  # two whole epochs and part of a third
            next(loader)
        loader.audit.close()
    report = audit_run(tmp_path)
    assert report.ok, report.problems
    assert report.complete_epochs == 2
