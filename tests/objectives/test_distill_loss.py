"""Distillation losses: OpenCLIP's DistillClipLoss in value and gradients (1 process and 2 gloo
ranks), a naive loop for the sigmoid one, masking of unpaired, weight-0 and repeated rows, and
2 ranks x half the batch == 1 process x the whole batch."""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from kits.multiproc import run_world

from vltrain.objectives.distill import distill_loss, distill_sigmoid_loss
from vltrain.types import Rows, TeacherEmbeds

TEACHER_SCALE = 30.0
TEACHER_BIAS = -4.0


def _rows(n: int, *, seed: int = 0, d: int = 8, dt: int = 8, has_image=None, has_text=None, ids=None,
          weights: bool = False):
    """Unit student embeddings [n, d] and a teacher of width ``dt``, zero where a row lacks a side."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g), dim=1)
    txt = F.normalize(torch.randn(n, d, generator=g), dim=1)
    timg = F.normalize(torch.randn(n, dt, generator=g), dim=1)
    ttxt = F.normalize(torch.randn(n, dt, generator=g), dim=1)
    has_image = torch.ones(n, dtype=torch.bool) if has_image is None else torch.tensor(has_image, dtype=torch.bool)
    has_text = torch.ones(n, dtype=torch.bool) if has_text is None else torch.tensor(has_text, dtype=torch.bool)
    img, timg = img * has_image[:, None], timg * has_image[:, None]
    txt, ttxt = txt * has_text[:, None], ttxt * has_text[:, None]
    ids = torch.arange(n) if ids is None else torch.tensor(ids)
    w = torch.rand(n, generator=g) + 0.5 if weights else None
    teacher = TeacherEmbeds(timg, ttxt, torch.tensor(TEACHER_SCALE), torch.tensor(TEACHER_BIAS))
    return img, txt, Rows(has_image, has_text, ids, w, teacher=teacher)


def _take(img, txt, rows: Rows, index):
    t = rows.teacher
    w = None if rows.row_weights is None else rows.row_weights[index]
    teacher = TeacherEmbeds(t.image[index], t.text[index], t.scale, t.bias)
    return img[index], txt[index], Rows(rows.has_image[index], rows.has_text[index], rows.ids[index], w,
                                        teacher=teacher)


def _turn_around(img, txt, rows: Rows, i: int) -> None:
    """Negate row i's embeddings, the student's and the teacher's (in place)."""
    for x in (img, txt, rows.teacher.image, rows.teacher.text):
        x[i] = -x[i]


def _run(fn, img, txt, rows: Rows, log_scale: float = 2.5, bias: float = -3.0, rows_out: list | None = None):
    """The loss and its gradients w.r.t. the embeddings, the log scale (and the bias, sigmoid)."""
    img = img.clone().requires_grad_(True)
    txt = txt.clone().requires_grad_(True)
    scale = torch.tensor(log_scale, requires_grad=True)
    b = torch.tensor(bias, requires_grad=True)
    sigmoid = fn is distill_sigmoid_loss
    loss = fn(img, txt, scale, b, rows, rows_out) if sigmoid else fn(img, txt, scale, rows, rows_out)
    loss.backward()
    out = {"loss": loss.detach(), "img": img.grad, "txt": txt.grad, "scale": scale.grad}
    if sigmoid:
        out["bias"] = b.grad
    return out


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _assert_close(got: dict, want: dict, rtol: float = 1e-6) -> float:
    """Relative error of each value and gradient as a whole (norm of the difference / norm); the largest."""
    errors = {k: _error(got[k], want[k]) for k in got}
    assert max(errors.values()) <= rtol, errors
    return max(errors.values())


# ---------------------------------------------------------------------------------------------
# OpenCLIP 3.3.0's DistillClipLoss


@functools.cache
def _openclip_loss():
    """open_clip/loss.py loaded by path: the package's __init__ imports torchvision, which is not
    installed; loss.py itself needs only torch (its horovod import is optional)."""
    folder = importlib.util.find_spec("open_clip").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("open_clip_loss", folder + "/loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _openclip_distill(img, txt, rows: Rows, log_scale: float = 2.5, rank: int = 0, world: int = 1) -> dict:
    """OpenCLIP's distillation term, global matrix on every rank (local_loss=False, gather_with_grad).
    It takes exp'd scales: its logit_scale is exp of the leaf whose gradient is compared."""
    loss_fn = _openclip_loss().DistillClipLoss(local_loss=False, gather_with_grad=True, rank=rank, world_size=world)
    img = img.clone().requires_grad_(True)
    txt = txt.clone().requires_grad_(True)
    scale = torch.tensor(log_scale, requires_grad=True)
    t = rows.teacher
    out = loss_fn(img, txt, scale.exp(), t.image, t.text, t.scale, output_dict=True)
    out["distill_loss"].backward()
    return {"loss": out["distill_loss"].detach(), "img": img.grad, "txt": txt.grad, "scale": scale.grad}


@pytest.mark.parametrize("dt", [8, 12])
def test_one_process_matches_openclip_distill_clip_loss(dt):
    img, txt, rows = _rows(7, seed=1, dt=dt)
    _assert_close(_run(distill_loss, img, txt, rows), _openclip_distill(img, txt, rows))


# ---------------------------------------------------------------------------------------------
# One process, masking


@pytest.mark.parametrize("fn", [distill_loss, distill_sigmoid_loss])
def test_rows_without_a_pair_and_weight_zero_rows_change_nothing(fn):
    """Text-only, image-only and weight-0 rows (absent, as ``Rows.present`` makes them, which the
    objectives apply) leave the loss and the other rows' gradients as without them, and get none."""
    img, txt, rows = _rows(8, seed=2, has_image=[1, 0, 1, 1, 1, 1, 1, 1], has_text=[1, 1, 1, 0, 1, 1, 1, 1],
                           weights=True)
    rows.row_weights[5] = 0
    kept = torch.tensor([0, 2, 4, 6, 7])
    full = _run(fn, img, txt, rows.present())
    want = _run(fn, *_take(img, txt, rows, kept))
    got = dict(full, img=full["img"][kept], txt=full["txt"][kept])
    _assert_close(got, want)
    dropped = torch.tensor([1, 3, 5])
    assert not full["img"][dropped].any() and not full["txt"][dropped].any()


@pytest.mark.parametrize("fn", [distill_loss, distill_sigmoid_loss])
def test_the_same_sample_twice_is_never_a_negative(fn):
    """Rows 0 and 3 are the same sample: row 0's loss does not depend on row 3 (student or teacher),
    while with distinct ids it does."""
    def row0_loss(ids, moved: bool):
        img, txt, rows = _rows(5, seed=3, ids=ids)
        if moved:
            _turn_around(img, txt, rows, 3)
        out: list = []
        _run(fn, img, txt, rows, rows_out=out)
        return out[0][0]

    same = [0, 1, 2, 0, 4]
    assert row0_loss(same, moved=True) == row0_loss(same, moved=False)
    assert row0_loss(None, moved=True) != row0_loss(None, moved=False)


# ---------------------------------------------------------------------------------------------
# Sigmoid distillation against a naive loop


def _naive_sigmoid(img, txt, rows: Rows, log_scale: float, bias: float) -> float:
    t = rows.teacher
    valid = (rows.has_image & rows.has_text).tolist()
    weights = [1.0] * len(valid) if rows.row_weights is None else rows.row_weights.tolist()
    total = weight_sum = 0.0
    for i in range(len(valid)):
        if not valid[i]:
            continue
        weight_sum += weights[i]
        for j in range(len(valid)):
            if not valid[j] or (j != i and rows.ids[j] == rows.ids[i]):
                continue
            s = math.exp(log_scale) * float(img[i] @ txt[j]) + bias
            p = 1 / (1 + math.exp(-(float(t.scale) * float(t.image[i] @ t.text[j]) + float(t.bias))))
            log_sig = -math.log1p(math.exp(-s))
            log_not = -s + log_sig  # log sigmoid(-s) = log(1 - sigmoid(s))
            total += weights[i] * -(p * log_sig + (1 - p) * log_not)
    return total / weight_sum


@pytest.mark.parametrize("dt", [8, 12])
def test_sigmoid_distillation_matches_a_naive_loop(dt):
    img, txt, rows = _rows(6, seed=4, dt=dt, has_text=[1, 1, 0, 1, 1, 1], ids=[0, 1, 2, 3, 1, 5], weights=True)
    got = _run(distill_sigmoid_loss, img, txt, rows, log_scale=1.5, bias=-2.0)
    want = _naive_sigmoid(img.double(), txt.double(), rows, 1.5, -2.0)
    assert abs(float(got["loss"]) - want) <= 1e-6 * abs(want)


@pytest.mark.parametrize("fn", [distill_loss, distill_sigmoid_loss])
def test_no_gradient_when_the_student_is_the_teacher(fn):
    """The cross-entropy is least where the student's logits equal the teacher's; its value there is
    the teacher's entropy, not 0 (a cross-entropy, not a KL)."""
    img, txt, rows = _rows(6, seed=5)
    out = _run(fn, rows.teacher.image, rows.teacher.text, rows, log_scale=math.log(TEACHER_SCALE), bias=TEACHER_BIAS)
    assert out["loss"] > 0.1
    for k in ("img", "txt", "scale") + (("bias",) if fn is distill_sigmoid_loss else ()):
        assert out[k].abs().max() < 1e-5, (k, out[k])


def test_a_teacher_of_another_width_works():
    img, txt, rows = _rows(5, seed=6, d=8, dt=12)
    for fn in (distill_loss, distill_sigmoid_loss):
        out = _run(fn, img, txt, rows)
        assert out["img"].shape == (5, 8) and torch.isfinite(out["img"]).all() and torch.isfinite(out["loss"])
        assert out["img"].any()


# ---------------------------------------------------------------------------------------------
# Two gloo ranks


def _mixed_batch():
    """9 rows: text-only, image-only and weight-0 rows, weights, and one sample on both halves."""
    img, txt, rows = _rows(9, seed=7, dt=12, has_image=[1, 1, 0, 1, 1, 1, 1, 1, 1],
                           has_text=[1, 1, 1, 1, 1, 1, 0, 1, 1], ids=[0, 1, 2, 3, 4, 5, 6, 1, 8], weights=True)
    rows.row_weights[4] = 0
    return img, txt, rows.present()


SPLIT = 4  # rank 0 holds rows 0-3, rank 1 rows 4-8: uneven


def _world_worker(rank: int, world: int):
    out = {}
    # OpenCLIP: every row paired, distinct ids, weight 1, equal halves
    img, txt, rows = _take(*_rows(10, seed=8, dt=12), slice(5 * rank, 5 * rank + 5))
    out["openclip"] = (_run(distill_loss, img, txt, rows), _openclip_distill(img, txt, rows, rank=rank, world=world))
    part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, 9)
    for fn in (distill_loss, distill_sigmoid_loss):
        out[fn.__name__] = _run(fn, *_take(*_mixed_batch(), part))
        # sample 1 sits on both ranks: rank 1 turning its copy around leaves rank 0's row unchanged
        img, txt, rows = _take(*_mixed_batch(), part)
        if rank == 1:
            _turn_around(img, txt, rows, 3)
        per_row: list = []
        _run(fn, img, txt, rows, rows_out=per_row)
        out[fn.__name__ + "-moved"] = per_row[0]
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-process run for every check (process start-up dominates the cost)."""
    return run_world(_world_worker, timeout=120)


def test_two_ranks_match_openclip(two_ranks):
    """Each rank's embedding gradients are the same in both (world x the global loss's: OpenCLIP's
    gather sums every rank's full-matrix gradient); the scale's differ by rank, so what DDP keeps,
    their mean over ranks, is compared, and our values' mean with OpenCLIP's (global on each rank)."""
    ours, theirs = zip(*(r["openclip"] for r in two_ranks))
    for mine, ref in zip(ours, theirs):
        _assert_close({k: mine[k] for k in ("img", "txt")}, ref)
    mean = {k: torch.stack([o[k] for o in ours]).mean(0) for k in ("loss", "scale")}
    _assert_close(mean, theirs[0])
    _assert_close(mean, theirs[1])


@pytest.mark.parametrize("fn", [distill_loss, distill_sigmoid_loss])
def test_two_ranks_equal_one_process_with_the_global_batch(fn, two_ranks):
    """Mean of the values == the global loss; each rank's embedding gradients == world x the global
    loss's (DDP's average then gives the global gradient); the scale's and bias's mean == the global."""
    want = _run(fn, *_mixed_batch())
    parts = [r[fn.__name__] for r in two_ranks]
    got = {k: torch.stack([p[k] for p in parts]).mean(0) for k in parts[0] if k not in ("img", "txt")}
    got.update({k: torch.cat([p[k] for p in parts]) / len(parts) for k in ("img", "txt")})
    _assert_close(got, want)


@pytest.mark.parametrize("fn", [distill_loss, distill_sigmoid_loss])
def test_the_same_sample_on_two_ranks_is_never_a_negative(fn, two_ranks):
    """Rank 1 turned its copy of sample 1 around: rank 0's row of sample 1 scores as before (against
    the unmoved batch in one process), its other paired rows (0 and 3) do not."""
    moved = two_ranks[0][fn.__name__ + "-moved"]
    per_row: list = []
    _run(fn, *_mixed_batch(), rows_out=per_row)
    before = per_row[0][:SPLIT]
    assert _error(moved[1], before[1]) <= 1e-6
    assert ((moved - before)[[0, 3]].abs() > 1e-3).all()
