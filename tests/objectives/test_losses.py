"""Losses: reference values, masking of rows lacking a modality, hard negatives, MLM masking, and
exact distributed equivalence on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from kits.modelkit import grads, make_batch, max_relative_error, rows, small_task
from kits.multiproc import run_world

from vltrain.objectives.keyed import StepKey
from vltrain.objectives.losses import itc_loss, mask_tokens, mlm_loss, sample_negatives, siglip_loss
from vltrain.compose.task import Score
from vltrain.types import Rows


def _embeds(n: int, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(torch.randn(n, d, generator=g), dim=-1)


def test_itc_matches_clip_reference():
    img, txt = _embeds(6)
    scale = torch.tensor(2.0)
    ones = torch.ones(6, dtype=torch.bool)
    logits = scale.exp() * img @ txt.t()
    target = torch.arange(6)
    expected = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
    torch.testing.assert_close(itc_loss(img, txt, scale, Rows(ones, ones, torch.arange(6))), expected)


def test_siglip_matches_reference():
    img, txt = _embeds(5)
    scale, bias = torch.tensor(1.5), torch.tensor(-2.0)
    ones = torch.ones(5, dtype=torch.bool)
    logits = scale.exp() * img @ txt.t() + bias
    labels = 2 * torch.eye(5) - 1
    expected = -F.logsigmoid(labels * logits).sum() / 5
    torch.testing.assert_close(siglip_loss(img, txt, scale, bias, Rows(ones, ones, torch.arange(5))), expected)


def test_temperature_is_clamped_at_100():
    img, txt = _embeds(4)
    ones = torch.ones(4, dtype=torch.bool)
    high = itc_loss(img, txt, torch.tensor(9.0), Rows(ones, ones, torch.arange(4)))
    capped = itc_loss(img, txt, torch.log(torch.tensor(100.0)), Rows(ones, ones, torch.arange(4)))
    torch.testing.assert_close(high, capped)


def test_same_id_is_not_a_negative():
    img, txt = _embeds(4)
    ones = torch.ones(4, dtype=torch.bool)
    img[3], txt[3] = img[0], txt[0]  # row 3 is sample 0 again: rows 0 and 3 are not each other's negatives
    ids = torch.tensor([0, 1, 2, 0])
    logits = torch.tensor(1.0).exp() * img @ txt.t()
    logits[0, 3] = logits[3, 0] = float("-inf")
    target = torch.arange(4)
    expected = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
    torch.testing.assert_close(itc_loss(img, txt, torch.tensor(1.0), Rows(ones, ones, ids)), expected)


@pytest.mark.parametrize("objective", ["itc", "siglip"])
def test_rows_without_a_pair_change_nothing(objective):
    """Text-only and image-only rows leave the contrastive loss and every gradient unchanged."""
    loss = dict(itc=1.0, siglip=0.0) if objective == "itc" else dict(itc=0.0, siglip=1.0)
    full = make_batch(8, seed=3, has_image=[1, 0, 1, 1, 1, 0, 1, 1], has_text=[1, 1, 1, 0, 1, 1, 0, 1])
    paired = rows(full, torch.tensor([0, 2, 4, 7]))

    reference = small_task(**loss)
    out = reference(Score(paired))
    out.loss.backward()
    mixed = small_task(**loss)
    out_mixed = mixed(Score(full))
    out_mixed.loss.backward()

    torch.testing.assert_close(out_mixed.losses[objective], out.losses[objective], rtol=1e-6, atol=1e-7)
    assert max_relative_error(grads(mixed), grads(reference)) < 1e-5


def test_no_valid_pair_gives_zero_loss_and_finite_gradients():
    img, txt = _embeds(3)
    img.requires_grad_()
    none = torch.zeros(3, dtype=torch.bool)
    loss = itc_loss(img, txt, torch.tensor(1.0), Rows(none, torch.ones(3, dtype=torch.bool), torch.arange(3)))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(img.grad).all() and not img.grad.any()


def test_hard_negatives_never_share_the_row_id():
    g = torch.Generator().manual_seed(0)
    row_ids = torch.tensor([0, 1, 2, 3])
    col_ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 7])  # every sample appears twice among columns
    col_ok = torch.ones(9, dtype=torch.bool)
    sim = torch.randn(4, 9, generator=g) * 10
    for _ in range(200):
        index, found = sample_negatives(sim, row_ids, col_ids, col_ok, torch.rand(4, generator=g))
        assert found.all()
        assert (col_ids[index] != row_ids).all()


def test_hard_negatives_report_rows_without_candidates():
    ids = torch.tensor([5, 5, 5])
    index, found = sample_negatives(torch.randn(3, 3), ids, ids, torch.ones(3, dtype=torch.bool))
    assert not found.any() and index.shape == (3,)
    # a column without the needed modality is never drawn
    index, found = sample_negatives(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([0, 1, 2]),
                                    torch.tensor([True, True, False]))
    assert found.tolist() == [True, True] and index.tolist() == [1, 0]


def test_mask_tokens_is_deterministic_and_bert_like():
    ids = torch.randint(2, 1000, (64, 128))
    mask = torch.ones_like(ids)
    mask[:, 100:] = 0
    ids = ids * mask
    key = StepKey(seed=7, step=3)
    draws = tuple(key.uniform(s, torch.arange(64), 128) for s in (1, 2, 3))
    a = mask_tokens(ids, mask, mask_id=1, vocab_size=1000, pad_id=0, draws=draws)
    b = mask_tokens(ids, mask, mask_id=1, vocab_size=1000, pad_id=0, draws=draws)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    masked, labels = a
    picked = labels != -100
    assert not picked[:, 100:].any(), "padding is never picked"
    assert 0.13 < picked[:, :100].float().mean() < 0.17
    assert torch.equal(labels[picked], ids[picked])
    as_mask = (masked[picked] == 1).float().mean()
    unchanged = (masked[picked] == ids[picked]).float().mean()
    assert 0.75 < as_mask < 0.85 and 0.07 < unchanged < 0.14
    assert torch.equal(masked[~picked], ids[~picked])


def test_mlm_loss_without_picked_tokens_is_zero():
    logits = torch.randn(2, 3, 10, requires_grad=True)
    loss = mlm_loss(logits, torch.full((2, 3), -100))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()


# ---------------------------------------------------------------------------------------------
# 2 ranks x B == 1 process x 2B


def _global_batch():
    # a text-only row, an image-only row, per-row weights, and one sample id present on both ranks
    return make_batch(
        8, seed=11, has_image=[1, 1, 0, 1, 1, 1, 1, 1], has_text=[1, 1, 1, 1, 1, 0, 1, 1],
        ids=[0, 1, 2, 3, 4, 5, 1, 7], weights=True,
    )


LOSSES = {
    "itc": (dict(itc=1.0, siglip=0.0), 4),
    "siglip": (dict(itc=0.0, siglip=1.0), 4),
    "itc-unequal-local-batches": (dict(itc=1.0, siglip=0.0), 3),  # dynamic batching: 3 rows + 5 rows
    "siglip-unequal-local-batches": (dict(itc=0.0, siglip=1.0), 3),
}


def _equivalence_worker(rank, world):
    results = {}
    for name, (loss, split) in LOSSES.items():
        model = small_task(**loss)
        out = model(Score(rows(_global_batch(), slice(0, split) if rank == 0 else slice(split, 8))))
        out.loss.backward()
        g = grads(model)
        for v in g.values():  # what DDP does: average over ranks
            dist.all_reduce(v)
            v /= world
        value = out.loss.detach().clone()
        dist.all_reduce(value)
        results[name] = (value / world, g)
    return results


@pytest.fixture(scope="module")
def two_rank_results():
    """One 2-process run for every objective (process start-up dominates the cost)."""
    return run_world(_equivalence_worker, timeout=90)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("objective", LOSSES)
def test_two_ranks_equal_one_process_with_the_global_batch(objective, two_rank_results):
    model = small_task(**LOSSES[objective][0])
    out = model(Score(_global_batch()))
    out.loss.backward()
    expected = grads(model)
    for per_rank in two_rank_results:
        value, g = per_rank[objective]
        torch.testing.assert_close(value, out.loss.detach(), rtol=1e-5, atol=0)
        assert max_relative_error(g, expected) <= 1e-5
