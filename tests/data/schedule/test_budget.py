"""Budget packing: every row once, every batch within its budgets, one modality per batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kits.sampler_fixtures import shapes_lengths, table

from vltrain.data.schedule import budget
from vltrain.errors import UserError


def test_padded_width_rounds_up_to_multiple_of_8():
    assert [budget.padded_width(x) for x in (0, 1, 8, 9, 16, 77)] == [8, 8, 8, 16, 16, 80]
    assert budget.batch_tokens(np.array([3, 9, 12])) == 3 * 16


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 60), st.booleans()), min_size=1, max_size=300),
    batch_size=st.integers(1, 32),
    token_budget=st.integers(64, 1024),
    image_budget=st.integers(1, 32),
    world=st.integers(1, 4),
)
def test_pack_covers_each_row_once_within_budgets(rows, batch_size, token_budget, image_budget, world):
    lens = np.array([r[0] for r in rows])
    t = table(lens, has_image=[r[1] for r in rows])
    order = np.random.default_rng(0).permutation(len(lens))
    batches = budget.pack(order, t, batch_size=batch_size, token_budget=token_budget,
                          image_budget=image_budget, rng=np.random.default_rng(1))
    target = -(-len(batches) // world) * world
    batches = budget.split_to_multiple(batches, world)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lens)))
    if len(lens) >= target:  # enough rows to split up to the next multiple of the world
        assert len(batches) % world == 0
    for b in batches:
        assert 1 <= len(b) <= batch_size
        assert budget.batch_tokens(t.text_len[b]) <= token_budget
        assert t.has_image[b].sum() <= image_budget
        assert len(set(budget.modality(t, b).tolist())) == 1


def test_pack_groups_similar_lengths():
    lens = shapes_lengths(2000)
    t = table(lens)
    batches = budget.pack(np.arange(len(lens)), t, batch_size=64, token_budget=64 * 24, image_budget=64, rng=None)
    positions = sum(budget.batch_tokens(t.text_len[b]) for b in batches)
    floor = sum(budget.padded_width(int(x)) for x in lens)  # each row alone, rounded up to 8
    assert positions / floor <= 1.02


def test_token_budget_smaller_than_one_caption_is_a_user_error():
    t = table([40, 10])
    with pytest.raises(UserError, match="token_budget=32"):
        budget.pack(np.arange(2), t, batch_size=4, token_budget=32, image_budget=4, rng=None)


def test_split_to_multiple_gives_up_only_when_nothing_splits():
    one = [np.array([0])]
    assert budget.split_to_multiple(one, 2) == one
    out = budget.split_to_multiple([np.arange(5), np.arange(5, 7)], 4)
    assert len(out) == 4 and sorted(np.concatenate(out).tolist()) == list(range(7))


def _greedy_by_row(rows, lens, costs, batch_size, token_budget, multiple):
    """The packing rule stated row by row: close the batch when one more row would not fit."""
    batches, start, longest, spent = [], 0, 0, [0] * len(costs)
    for i in range(len(rows)):
        longest_with = max(longest, int(lens[i]))
        count = i - start + 1
        fits = (count <= batch_size and count * budget.padded_width(longest_with, multiple) <= token_budget
                and all(s + int(c[i]) <= limit for s, (c, limit) in zip(spent, costs)))
        if not fits and i > start:
            batches.append(rows[start:i])
            start, longest_with, spent = i, int(lens[i]), [0] * len(costs)
        longest = longest_with
        spent = [s + int(c[i]) for s, (c, _) in zip(spent, costs)]
    if start < len(rows):
        batches.append(rows[start:])
    return batches


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_pack_sorted_equals_the_row_by_row_rule(data):
    n = data.draw(st.integers(0, 200))
    multiple = data.draw(st.sampled_from([1, 2, 8]))
    lens = np.array(data.draw(st.lists(st.integers(0, 90), min_size=n, max_size=n)), dtype=np.int64)
    lens = lens[np.argsort(budget._widths(lens, multiple), kind="stable")]
    imgs = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    widest = budget.padded_width(int(lens.max()) if n else 0, multiple)
    batch_size = data.draw(st.integers(1, 64))
    token_budget = data.draw(st.integers(widest, 700))
    costs = [(imgs, data.draw(st.integers(1, 40)))]
    if data.draw(st.booleans()):  # a patch budget: each image its grid's patches
        patches = np.where(imgs, np.array(data.draw(st.lists(st.integers(1, 64), min_size=n, max_size=n)),
                                          dtype=np.int64), 0)
        costs.append((patches, data.draw(st.integers(64, 600))))
    rows = np.arange(n) + 1000
    want = _greedy_by_row(rows, lens, costs, batch_size, token_budget, multiple)
    got = budget._pack_sorted(rows, lens, costs, batch_size, token_budget, multiple)
    assert [b.tolist() for b in got] == [b.tolist() for b in want]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), patch_budget=st.integers(64, 2000), seed=st.integers(0, 5))
def test_a_patch_budget_bounds_every_batch_and_lets_small_images_share_one(rows, patch_budget, seed):
    rng = np.random.default_rng(seed)
    has_image = rng.random(rows) > 0.1
    patches = np.where(has_image, rng.integers(1, 65, rows), 0)
    t = table(rng.integers(3, 30, rows), has_image, patches=patches)
    batches = budget.pack(rng.permutation(rows), t, batch_size=64, token_budget=64 * 32, image_budget=64,
                          rng=np.random.default_rng(seed), patch_budget=patch_budget)
    assert sorted(np.concatenate(batches).tolist()) == list(range(rows))
    for b in batches:
        assert int(t.patches[b].sum()) <= patch_budget
    small = table(np.full(64, 10), patches=np.full(64, 4))  # 64 images of 4 patches: one batch of all
    assert len(budget.pack(np.arange(64), small, batch_size=64, token_budget=64 * 16, image_budget=64, rng=None,
                           patch_budget=256)) == 1
    large = table(np.full(64, 10), patches=np.full(64, 64))  # of 64 patches: 4 a batch
    assert {len(b) for b in budget.pack(np.arange(64), large, batch_size=64, token_budget=64 * 16, image_budget=64,
                                        rng=None, patch_budget=256)} == {4}


def test_a_patch_budget_under_one_image_is_refused():
    t = table([10, 10], patches=[64, 100])
    with pytest.raises(UserError, match="data.patch_budget=80 is smaller than one image's 100 patches"):
        budget.pack(np.arange(2), t, batch_size=4, token_budget=64, image_budget=4, rng=None, patch_budget=80)
    with pytest.raises(UserError, match="data.patch_budget=500 is too small .* at least 8 images .* at least 512"):
        budget.check_step_budgets(16, 400, 16, 20, 1, patch_budget=500, max_patches=64)


# -- global steps (data.global_batch_size with budget batching) ------------------------------


def _steps(parts: list[np.ndarray], slots: int) -> list[np.ndarray]:
    return [np.sort(np.concatenate(parts[i : i + slots])) for i in range(0, len(parts), slots)]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(40, 400), global_batch=st.sampled_from([8, 16, 32]), seed=st.integers(0, 5),
       slack=st.integers(0, 3))
def test_global_steps_are_the_same_for_every_split_and_within_the_step_budgets(rows, global_batch, seed, slack):
    rng = np.random.default_rng(seed)
    text_len = rng.integers(3, 40, rows)
    has_image = rng.random(rows) > 0.2  # text-only rows
    has_text = ~(has_image & (rng.random(rows) < 0.15))  # and image-only ones
    t = table(np.where(has_text, text_len, 0), has_image, has_text)
    max_len, multiple = 40, 1
    need = 2 * budget.min_step_rows(global_batch)
    tokens, images = need * max_len + slack * 37, need + slack
    t = table(t.text_len, has_image, has_text, patches=np.where(has_image, rng.integers(1, 17, rows), 0))
    patch_budget = (need * 16 + slack * 11) if seed % 2 else 0  # images of up to 16 patches
    budget.check_step_budgets(global_batch, tokens, images, max_len, multiple, patch_budget, 16)
    order = rng.permutation(rows)
    least = budget.min_step_rows(global_batch)
    by_split = {}
    for slots in [s for s in (1, 2, 4, 8) if s <= least]:
        parts = budget.pack_steps(order, t, global_batch=global_batch, slots=slots, token_budget=tokens,
                                  image_budget=images, rng=np.random.default_rng(seed), pad_multiple=multiple,
                                  patch_budget=patch_budget)
        assert len(parts) % slots == 0
        sizes = [len(p) for p in parts]
        assert min(sizes) >= 1 and max(sizes) <= -(-global_batch // slots)
        steps = _steps(parts, slots)
        for part_sizes in (sizes[i : i + slots] for i in range(0, len(sizes), slots)):
            assert max(part_sizes) - min(part_sizes) <= 1  # balanced in rows
        by_split[slots] = [s.tolist() for s in steps]
        for s in steps:
            assert least <= len(s) <= global_batch
            assert budget.batch_tokens(t.text_len[s], multiple) <= tokens
            assert int(t.has_image[s].sum()) <= images
            assert not patch_budget or int(t.patches[s].sum()) <= patch_budget
        assert sorted(np.concatenate(steps).tolist()) == list(range(rows))  # every row once
    first = by_split[1]
    assert all(v == first for v in by_split.values())


def test_global_steps_keep_one_modality_where_they_can():
    rows = 600
    has_image = np.arange(rows) % 5 != 0
    t = table(np.full(rows, 12), has_image)
    parts = budget.pack_steps(np.arange(rows), t, global_batch=32, slots=4, token_budget=32 * 12,
                              image_budget=32, rng=None, pad_multiple=1)
    mixed = [s for s in _steps(parts, 4) if 0 < int(t.has_image[s].sum()) < len(s)]
    assert len(mixed) <= 1  # only the rows each modality leaves over share a step


def test_too_many_micro_batches_or_too_small_budgets_are_refused():
    t = table(np.full(64, 10))
    with pytest.raises(UserError, match="use a data.micro_batch_size of at least 4"):
        budget.pack_steps(np.arange(64), t, global_batch=16, slots=8, token_budget=400, image_budget=16, rng=None)
    with pytest.raises(UserError, match="data.token_budget=100 is too small .* at least 160"):
        budget.check_step_budgets(16, 100, 16, 20, 1)
    with pytest.raises(UserError, match="data.image_budget=4 is too small .* at least 8"):
        budget.check_step_budgets(16, 400, 4, 20, 1)
