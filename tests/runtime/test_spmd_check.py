"""Shape-safe collectives and the SPMD check, on real gloo ranks.

A tensor that crosses ranks may differ between them in any dimension: the gathers must pad every
dimension, and ``train.debug_spmd`` must name a divergence (the fusion model's text-width crash,
reverted on purpose here) before the mismatched collective runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kits.multiproc import run_world
from kits.spmd_fixtures import config, make_mixed_shapes, run_trainer


def _ragged(rank: int) -> torch.Tensor:
    """Rank r holds r + 2 rows of width 3 - r (every dimension differs between ranks)."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(rank + 2, 3 - rank, 4, generator=g, dtype=torch.float64)


def _gather_worker(rank: int, world: int, reduce_scatter: bool):
    import vltrain.runtime.distributed as d

    d.REDUCE_SCATTER = reduce_scatter
    x = _ragged(rank).requires_grad_(True)
    shapes = d.exchange_shapes(x)[0]
    plain = d.all_gather_no_grad(x, pad_value=-1.0)
    gathered = d.all_gather_with_grad(x, shapes)
    # a loss that weighs every gathered entry differently on every rank
    w = torch.arange(gathered.numel(), dtype=torch.float64).view_as(gathered) * (rank + 1)
    (gathered * w).sum().backward()
    return {"shapes": shapes, "plain": plain, "gathered": gathered.detach(), "grad": x.grad,
            "reduce_scatter_used": d.REDUCE_SCATTER}


def test_gathers_pad_every_dimension_and_send_gradients_home():
    results = run_world(_gather_worker, (True,))
    parts = [_ragged(r) for r in range(2)]
    expected_plain = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 3 - p.shape[1]), value=-1.0) for p in parts])
    for r, out in enumerate(results):
        assert out["shapes"] == [(2, 3, 4), (3, 2, 4)]
        assert torch.equal(out["plain"], expected_plain)
        assert out["gathered"].shape == (5, 3, 4)
    # the gradient of sum over ranks of (gathered * w_r), sliced to each rank's own entries
    total_w = sum(torch.arange(60, dtype=torch.float64).view(5, 3, 4) * (r + 1) for r in range(2))
    assert torch.equal(results[0]["grad"], total_w[:2, :3])
    assert torch.equal(results[1]["grad"], total_w[2:, :2])
    assert results[0]["reduce_scatter_used"]  # gloo has reduce-scatter: the backward used it


def test_reduce_scatter_backward_equals_the_all_reduce_fallback():
    scattered = run_world(_gather_worker, (True,))
    reduced = run_world(_gather_worker, (False,))
    for a, b in zip(scattered, reduced):
        assert torch.equal(a["grad"], b["grad"])


def _extra_collective_worker(rank: int, world: int):
    from vltrain.runtime.distributed import all_reduce_sum
    from vltrain.runtime.spmd import RECORDER, SPMDError

    RECORDER.checking = True
    RECORDER.begin("in step 7")
    try:
        all_reduce_sum(torch.ones(3))
        if rank == 1:
            all_reduce_sum(torch.ones(1))  # a collective only this rank issues
        RECORDER.end()
    except SPMDError as e:
        return str(e)
    finally:
        RECORDER.checking = False
    return None


def test_debug_spmd_catches_a_collective_only_one_rank_issues():
    messages = run_world(_extra_collective_worker)
    assert messages[0] == messages[1] and messages[0] is not None
    msg = messages[0]
    assert "in step 7" in msg and "collective #2" in msg
    assert "rank 0 issued step end" in msg and "rank 1 issued all_reduce of float32[1]" in msg


def _reverted_fix_worker(rank: int, world: int, root: str, run_dir: str):
    """The fusion model with global ITM negatives, with the gathers padding only dim 0 (as before
    the fix): debug_spmd must stop both ranks with a message, not let gloo abort."""
    import vltrain.runtime.distributed as d
    from vltrain.runtime.spmd import SPMDError

    d._padded_shape = lambda shapes: (max(s[0] for s in shapes), *shapes[rank][1:])
    cfg = config(Path(root), Path(run_dir) / "reverted", [
        "model.preset=tiny-albef", "model.loss.itm=0.5", "model.loss.itm_negatives=global",
        "data.batching=budget", "train.max_steps=8",
    ])
    try:
        run_trainer(cfg)
    except SPMDError as e:
        return str(e)
    return None


def test_debug_spmd_names_the_text_width_divergence_when_the_fix_is_reverted(tmp_path):
    root = make_mixed_shapes(tmp_path / "shapes")
    messages = run_world(_reverted_fix_worker, (str(root), str(tmp_path)), timeout=120)
    assert messages[0] is not None and messages[0] == messages[1]
    msg = messages[0]
    assert "SPMD check (train.debug_spmd): the ranks diverged in step " in msg
    assert "rank 0 issued all_gather of float32[" in msg and "rank 1 issued all_gather of float32[" in msg


def _fixed_worker(rank: int, world: int, root: str, run_dir: str, overrides: list[str]):
    cfg = config(Path(root), Path(run_dir) / "fixed", overrides)
    return run_trainer(cfg)


@pytest.mark.parametrize("batching", ["budget", "fixed"])
def test_fusion_model_trains_across_ranks_whose_text_widths_differ(tmp_path, batching):
    """The two runs of the bug report: budget batching, and fixed micro-batches on mostly text-only data."""
    root = make_mixed_shapes(tmp_path / "shapes")
    overrides = ["model.preset=tiny-albef", "model.loss.itm=0.5", "model.loss.itm_negatives=global",
                 f"data.batching={batching}", "train.max_steps=10"]
    results = run_world(_fixed_worker, (str(root), str(tmp_path), overrides), timeout=120)
    assert results[0]["steps"] == results[1]["steps"] == 10
    assert results[0]["finite"] and len(results[0]["losses"]) == 10
    assert any(a != b for a, b in zip(results[0]["widths"], results[1]["widths"])), "widths never differed"
