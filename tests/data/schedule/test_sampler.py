"""The distributed batch sampler, all ranks instantiated in one process (no decoding, no workers)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from kits.sampler_fixtures import shapes_lengths, table

from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.errors import UserError


def samplers(t, world, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("image_budget", kw["batch_size"])  # DataConfig.resolve()'s default
    kw.setdefault("seed", 3)
    return [DistributedBatchSampler(t, Schedule(**kw), rank=r, world_size=world) for r in range(world)]


def epoch_ids(ss) -> list[list[list[int]]]:
    return [list(s) for s in ss]


@pytest.mark.parametrize("batching", ["fixed", "budget"])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("n,world", [(37, 2), (40, 4), (13, 3), (101, 3)])
def test_equal_step_counts_disjoint_ranks_documented_remainder(batching, remainder, n, world):
    t = table(shapes_lengths(n), has_image=np.arange(n) % 3 != 0)
    ss = samplers(t, world, batching=batching, remainder=remainder, token_budget=4 * 40)
    per_rank = epoch_ids(ss)
    assert len({len(b) for b in per_rank}) == 1 and all(len(b) == len(s) for b, s in zip(per_rank, ss))
    plan0 = ss[0].plan()
    rows = [i for r, s in enumerate(ss) for batch, rep in zip(per_rank[r], s.plan().repeats)
            for i, is_rep in zip(batch, rep) if not is_rep]
    assert len(rows) == len(set(rows)) == plan0.distinct  # first occurrences never collide across ranks
    assert plan0.distinct + plan0.dropped == n
    assert sum(len(b) for r in per_rank for b in r) == n - plan0.dropped + plan0.padded
    if batching == "fixed":
        assert all(len(b) == 4 for r in per_rank for b in r)
    if batching == "budget" and n >= world:
        assert plan0.dropped == plan0.padded == 0  # splitting batches equalizes without repeats


def test_deterministic_per_seed_and_epoch():
    t = table(shapes_lengths(50))
    a, b = samplers(t, 2), samplers(t, 2)
    assert epoch_ids(a) == epoch_ids(b)
    e0 = epoch_ids(a)
    for s in a:
        s.set_epoch(1)
    assert epoch_ids(a) != e0
    assert epoch_ids(samplers(t, 2, seed=4)) != e0


def test_no_shuffle_keeps_dataset_order():
    t = table(shapes_lengths(16))
    (s,) = samplers(t, 1, shuffle=False)
    assert [i for b in s for i in b] == list(range(16))


def test_state_restore_resumes_at_first_unconsumed_batch():
    t = table(shapes_lengths(60))
    (s,) = samplers(t, 1, batching="budget", token_budget=4 * 40)
    s.set_epoch(2)
    full = list(s)
    s.mark_consumed(3)
    (r,) = samplers(t, 1, batching="budget", token_budget=4 * 40)
    r.load_state_dict(s.state_dict())
    assert r.epoch == 2 and list(r) == full[3:]


def test_restore_with_a_different_world_is_refused():
    t = table(shapes_lengths(20))
    state = samplers(t, 2)[0].state_dict()
    with pytest.raises(UserError, match="world_size=2"):
        samplers(t, 1)[0].load_state_dict(state)


def test_drop_with_too_few_samples_is_a_user_error():
    (s,) = samplers(table(shapes_lengths(3)), 1, remainder="drop")
    with pytest.raises(UserError, match="remainder=pad"):
        len(s)


def test_remainder_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="vltrain.data.schedule.sampler"):
        len(samplers(table(shapes_lengths(10)), 2, remainder="pad")[0])
    assert "remainder=pad" in caplog.text and "6 rows padded" in caplog.text


def test_mixing_defines_epoch_by_samples_and_weights():
    # source 0: 1000 image-text rows, source 1: 50 text-only rows, weighted 3:1
    n0, n1 = 1000, 50
    t = table(np.full(n0 + n1, 12), has_image=[True] * n0 + [False] * n1, source=[0] * n0 + [1] * n1)
    ss = samplers(t, 2, batch_size=10, source_weights=[3.0, 1.0], epoch_size=400)
    rows = np.array([i for s in ss for b in s for i in b])
    assert len(rows) == 400
    assert (rows >= n0).sum() == 100  # a quarter from the small source, which repeats after a full pass
    assert len(set(rows[rows >= n0].tolist())) == n1
    assert len(set(rows[rows < n0].tolist())) == 300
    # The large source is read without replacement across epochs: 300 new rows per epoch until
    # its first pass ends in epoch 3.
    seen = []
    for e in range(4):
        for s in ss:
            s.set_epoch(e)
        seen += [i for s in ss for b in s for i in b if i < n0]
    assert len(set(seen[:900])) == 900 and len(set(seen)) == n0


def test_mixing_rejects_bad_weights():
    t = table(np.full(10, 5), source=[0] * 5 + [1] * 5)
    with pytest.raises(UserError, match="one weight per source"):
        samplers(t, 1, source_weights=[1.0])
    with pytest.raises(UserError, match="positive sum"):
        samplers(t, 1, source_weights=[0.0, 0.0])


def test_budget_batches_change_composition_between_epochs():
    # Fewer rows than one sorting window: a plain length sort would give the same batches every epoch.
    (s,) = samplers(table(shapes_lengths(60)), 1, batching="budget", batch_size=8, token_budget=8 * 40)
    first = {tuple(sorted(b)) for b in s}
    s.set_epoch(1)
    second = {tuple(sorted(b)) for b in s}
    assert len(first & second) < len(first) / 2


@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("window", [0, 2])
def test_a_global_batch_ends_every_split_s_epoch_at_the_same_step(remainder, window):
    """64 rows and a global batch of 12: the epoch is padded (or cut) to whole global batches, so a
    step of 2 micro-batches never spans two epochs, whatever the split."""
    t = table(np.full(64, 5))
    if window:
        t.blocks = np.r_[np.arange(0, 64, 8), 64]
    for world, micro in [(1, 12), (1, 6), (2, 6), (2, 3)]:
        schedule = Schedule(batch_size=micro, seed=0, remainder=remainder, global_batch=12, window=window)
        plan = DistributedBatchSampler(t, schedule, rank=0, world_size=world).plan()
        accumulation = 12 // (world * micro)
        assert len(plan) == (6 if remainder == "pad" else 5) * accumulation
        assert (plan.padded, plan.dropped) == ((8, 0) if remainder == "pad" else (0, 4))
