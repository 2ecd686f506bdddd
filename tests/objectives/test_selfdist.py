"""SILC and TIPS losses and the teacher's centre (vltrain.objectives.selfdist): against loops written
from DINO's formulas, gradients to the student only, TIPS blind to unmasked patches, and a batch split
into micro-batches (denominators and centre sums added) giving the unsplit loss, gradient and centre."""

import pytest
import torch
import torch.nn.functional as F

from vltrain.objectives.selfdist import (centre_sums, silc_denominator, silc_loss, soft_cross_entropy,
                                         teacher_targets, tips_denominator, tips_loss, updated_centre)

K = 16
T_S, T_T = 0.1, 0.04


def _logits(*shape: int, seed: int) -> torch.Tensor:
    """Cosine-like logits in [-1, 1], as the prototype heads give."""
    return torch.rand(*shape, K, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _ce(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """DINO's term for one student row and one target row, in fp64."""
    return -(t.double() * F.log_softmax(s.double() / T_S, dim=-1)).sum()


def test_teacher_targets_are_the_centred_sharpened_softmax_without_a_gradient():
    t = _logits(3, 5, seed=0).requires_grad_()
    centre = _logits(seed=1)
    targets = teacher_targets(t, centre, T_T)
    expected = torch.exp((t.detach() - centre) / T_T)
    torch.testing.assert_close(targets, expected / expected.sum(dim=-1, keepdim=True))
    assert not targets.requires_grad
    assert torch.allclose(teacher_targets(centre[None], centre, T_T), torch.full((1, K), 1 / K))  # centred away
    assert teacher_targets(t.detach().bfloat16(), centre, T_T).dtype == torch.float32


def test_silc_is_every_local_view_against_its_rows_global_target():
    student = _logits(4, 3, seed=2)
    targets = teacher_targets(_logits(4, seed=3), torch.zeros(K), T_T)
    w = torch.tensor([1.0, 0.5, 0.0, 2.0])
    terms = [(w[i], _ce(student[i, v], targets[i])) for i in range(4) for v in range(3)]
    expected = sum(wi * ce for wi, ce in terms) / sum(wi for wi, _ in terms)
    rows: list = []
    assert silc_loss(student, targets, T_S, w, rows_out=rows).item() == pytest.approx(expected.item(), rel=1e-6)
    assert silc_loss(student, targets, T_S).item() == pytest.approx(
        sum(ce for _, ce in terms).item() / 12, rel=1e-6)
    torch.testing.assert_close(rows[0], torch.stack([sum(_ce(student[i, v], targets[i]) for v in range(3)) / 3
                                                     for i in range(4)]).float())
    flat = soft_cross_entropy(student.flatten(0, 1), targets.repeat_interleave(3, dim=0), T_S, w.repeat_interleave(3))
    assert flat.item() == pytest.approx(expected.item(), rel=1e-6)


def test_tips_is_a_mean_over_the_masked_patches_only():
    student = _logits(3, 6, seed=4)
    targets = teacher_targets(_logits(3, 6, seed=5), _logits(seed=6), T_T)
    mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(7)) < 0.5
    mask[2] = False  # a row with nothing masked
    w = torch.tensor([1.0, 3.0, 1.0])
    terms = [(w[i], _ce(student[i, n], targets[i, n])) for i in range(3) for n in range(6) if mask[i, n]]
    expected = sum(wi * ce for wi, ce in terms) / sum(wi for wi, _ in terms)
    rows: list = []
    assert tips_loss(student, targets, mask, T_S, w, rows_out=rows).item() == pytest.approx(expected.item(), rel=1e-6)
    assert rows[0][2] == 0
    assert tips_denominator(mask, w).item() == sum(wi for wi, _ in terms).item()


def test_tips_ignores_unmasked_positions_in_value_and_gradient():
    student = _logits(2, 8, seed=8).requires_grad_()
    targets = teacher_targets(_logits(2, 8, seed=9), torch.zeros(K), T_T)
    mask = torch.tensor([[True, False] * 4, [False, True] * 4])
    tips_loss(student, targets, mask, T_S).backward()
    changed = torch.where(mask[..., None], student.detach(), _logits(2, 8, seed=10) * 50).requires_grad_()
    loss = tips_loss(changed, targets, mask, T_S)
    loss.backward()
    assert loss.item() == tips_loss(student.detach(), targets, mask, T_S).item()
    torch.testing.assert_close(changed.grad, student.grad)
    assert (changed.grad[~mask] == 0).all() and (changed.grad[mask] != 0).any()


def test_the_gradient_reaches_the_student_only_and_is_dinos():
    teacher = _logits(5, seed=11).requires_grad_()
    student = _logits(5, 2, seed=12).requires_grad_()
    targets = teacher_targets(teacher, torch.zeros(K), T_T)
    leaked = targets.clone().requires_grad_()  # a caller's targets that still carry a graph
    silc_loss(student, leaked, T_S).backward()
    assert teacher.grad is None and leaked.grad is None
    # d/ds of -sum t log softmax(s / T) is (softmax(s / T) - t) / T, per (row, view), over the 10 pairs
    expected = (torch.softmax(student.detach() / T_S, dim=-1) - targets[:, None]) / T_S / 10
    torch.testing.assert_close(student.grad, expected)


def _batch(seed: int, b: int = 8, n: int = 6, views: int = 3):
    g = torch.Generator().manual_seed(seed)
    return dict(local=_logits(b, views, seed=seed), patches=_logits(b, n, seed=seed + 1),
                teacher=_logits(b, seed=seed + 2), teacher_patches=_logits(b, n, seed=seed + 3),
                mask=torch.rand(b, n, generator=g) < 0.5, weights=torch.rand(b, generator=g) + 0.5,
                has_image=torch.rand(b, generator=g) < 0.8)


def _step(batch: dict, parts: list[slice], centre: torch.Tensor, patch_centre: torch.Tensor):
    """One step over ``parts`` of the batch as micro-batches: the denominators and centre sums
    added over them first (as the ranks' all-reduce would), every part scored against them."""
    w = batch["weights"] * batch["has_image"]
    silc_total = sum(silc_denominator(w[p], 3) for p in parts)
    tips_total = sum(tips_denominator(batch["mask"][p], w[p]) for p in parts)
    local = batch["local"].clone().requires_grad_()
    patches = batch["patches"].clone().requires_grad_()
    loss = torch.zeros(())
    sums = [torch.zeros(K), torch.zeros(()), torch.zeros(K), torch.zeros(())]
    for p in parts:
        targets = teacher_targets(batch["teacher"][p], centre, T_T)
        patch_targets = teacher_targets(batch["teacher_patches"][p], patch_centre, T_T)
        part = (silc_loss(local[p], targets, T_S, w[p], silc_total)
                + tips_loss(patches[p], patch_targets, batch["mask"][p], T_S, w[p], tips_total))
        part.backward()
        loss = loss + part.detach()
        real = batch["has_image"][p]
        found = (centre_sums(batch["teacher"][p], real)
                 + centre_sums(batch["teacher_patches"][p], real[:, None].expand(-1, 6)))
        sums = [a + b for a, b in zip(sums, found)]
    return (loss, local.grad, patches.grad, updated_centre(centre, sums[0], sums[1]),
            updated_centre(patch_centre, sums[2], sums[3]))


def test_a_batch_split_into_micro_batches_gives_the_unsplit_loss_gradient_and_centres():
    batch = _batch(20)
    centre, patch_centre = _logits(seed=30), _logits(seed=31)
    whole = _step(batch, [slice(0, 8)], centre, patch_centre)
    for parts in ([slice(0, 4), slice(4, 8)], [slice(0, 3), slice(3, 8)]):
        split = _step(batch, parts, centre, patch_centre)
        for a, b in zip(split, whole):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the centre is the EMA of the mean teacher logit over the rows with an image (and their patches)
    real = batch["has_image"]
    torch.testing.assert_close(whole[3], 0.9 * centre + 0.1 * batch["teacher"][real].mean(dim=0))
    torch.testing.assert_close(whole[4], 0.9 * patch_centre + 0.1 * batch["teacher_patches"][real].mean(dim=(0, 1)))


def test_the_centre_stays_when_nothing_was_counted():
    centre = _logits(seed=40)
    sums, count = centre_sums(_logits(3, seed=41), torch.zeros(3, dtype=torch.bool))
    assert count.item() == 0
    assert torch.equal(updated_centre(centre, sums, count), centre)
    sums, count = centre_sums(_logits(3, 2, seed=42))
    assert count.item() == 6 and sums.shape == (K,)
    assert silc_loss(_logits(2, 3, seed=43), torch.full((2, K), 1 / K), T_S, torch.zeros(2)).item() == 0
