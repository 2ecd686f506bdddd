"""The ring ITC and SigLIP equal the gathering ones in value and gradients (to fp32 rounding), on
1, 2 and 4 ranks, and keep nothing for the backward whose size grows with the number of ranks."""

from __future__ import annotations

import pytest
import torch
from kits.multiproc import run_world

from vltrain.objectives.losses import itc_loss, siglip_loss
from vltrain.objectives.ring import itc_loss_ring, siglip_loss_ring
from vltrain.types import Rows


def _batch(rank: int, rows: int, seed: int = 0):
    """Unit embeddings, a text-only and an image-only row, weights, and an id shared across ranks."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    img = torch.nn.functional.normalize(torch.randn(rows, 8, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(rows, 8, generator=g), dim=1)
    has_image = torch.ones(rows, dtype=torch.bool)
    has_text = torch.ones(rows, dtype=torch.bool)
    has_image[1] = False  # text-only
    has_text[-1] = False  # image-only
    ids = torch.arange(rows) + 1000 * rank
    ids[2] = 7  # the same sample on every rank: never a negative of itself
    weights = torch.rand(rows, generator=g) + 0.5
    return img, txt, has_image, has_text, ids, weights


def _value_and_grads(fn, siglip: bool, img, txt, has_image, has_text, ids, weights, scale0: float):
    img = img.clone().requires_grad_(True)
    txt = txt.clone().requires_grad_(True)
    scale = torch.tensor(scale0, requires_grad=True)
    bias = torch.tensor(-3.0, requires_grad=True)
    rows = Rows(has_image, has_text, ids, weights)
    loss = fn(img, txt, scale, bias, rows) if siglip else fn(img, txt, scale, rows)
    loss.backward()
    out = {"loss": loss.detach(), "img": img.grad, "txt": txt.grad, "scale": scale.grad}
    if siglip:
        out["bias"] = bias.grad
    return out


def _assert_close(a: dict, b: dict, rtol: float) -> None:
    """Relative error of each value and gradient, as a whole (norm of the difference / norm)."""
    for k in a:
        error = (a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)
        assert error <= rtol, (k, float(error), a[k], b[k])


CASES = [(itc_loss, itc_loss_ring, False), (siglip_loss, siglip_loss_ring, True)]


@pytest.mark.parametrize("gathered,ring,siglip", CASES)
@pytest.mark.parametrize("scale0", [2.0, 5.0])  # 5.0 is above the clamp at ln 100: no scale gradient
def test_one_process_equals_the_gathering_loss(gathered, ring, siglip, scale0):
    batch = _batch(0, 6)
    want = _value_and_grads(gathered, siglip, *batch, scale0)
    got = _value_and_grads(ring, siglip, *batch, scale0)
    _assert_close(got, want, 2e-5)  # fp32 rounding; logits reach 100 at the clamp
    if scale0 > 4.61:
        assert got["scale"] == 0


def _world_worker(rank: int, world: int, rows_by_rank: list[int]):
    batch = _batch(rank, rows_by_rank[rank], seed=1)
    out = {}
    for gathered, ring, siglip in CASES:
        name = "siglip" if siglip else "itc"
        out[name] = (_value_and_grads(gathered, siglip, *batch, 2.5), _value_and_grads(ring, siglip, *batch, 2.5))
    return out


@pytest.mark.parametrize("rows_by_rank", [[5, 7], [4, 6, 5, 8]])
def test_ranks_with_uneven_batches_equal_the_gathering_loss(rows_by_rank):
    results = run_world(_world_worker, (rows_by_rank,), world=len(rows_by_rank), timeout=120)
    for rank, out in enumerate(results):
        for name, (want, got) in out.items():
            _assert_close(got, want, 2e-5)


def test_what_the_backward_keeps_does_not_depend_on_the_world_size():
    from vltrain.objectives.ring import _RingITC

    img, txt, has_image, has_text, ids, weights = _batch(0, 6)
    img.requires_grad_(True)
    loss = itc_loss_ring(img, txt, torch.tensor(2.0, requires_grad=True), Rows(has_image, has_text, ids, weights))
    node = loss.grad_fn
    assert node.name().startswith(_RingITC.__name__)
    shapes = [tuple(t.shape) for t in node.saved_tensors]
    # this rank's rows and per-row statistics only: nothing with the global batch's size
    assert all(s == () or s[0] == 6 for s in shapes), shapes


def _trainer_worker(rank: int, world: int, root: str, run_dir: str):
    from pathlib import Path

    from kits.spmd_fixtures import config, run_trainer

    out = {}
    for objective in (["model.loss.itc=1"], ["model.loss.itc=0", "model.loss.siglip=1"]):
        for impl in ("gather", "ring"):
            name = f"{objective[-1]}-{impl}"
            cfg = config(Path(root), Path(run_dir) / name, objective + [
                "model.preset=tiny-clip", f"model.loss.contrastive_impl={impl}", "data.batching=budget",
                "train.accumulation=2", "train.contrastive_accumulation=gradcache", "train.max_steps=5"])
            out[name] = run_trainer(cfg)["losses"]
    return out


def test_training_with_the_ring_follows_the_gathering_loss_curve(tmp_path):
    """Through the trainer on 2 ranks, budget batches of different sizes, gradcache over 2 micro-batches."""
    from kits.spmd_fixtures import make_mixed_shapes

    root = make_mixed_shapes(tmp_path / "shapes")
    curves = run_world(_trainer_worker, (str(root), str(tmp_path)), timeout=240)[0]
    for objective in ("model.loss.itc=1", "model.loss.siglip=1"):
        gather, ring = torch.tensor(curves[f"{objective}-gather"]), torch.tensor(curves[f"{objective}-ring"])
        assert len(gather) == 5 and torch.allclose(ring, gather, rtol=1e-4), (objective, gather, ring)
