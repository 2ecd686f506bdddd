"""Every rank runs the same graph whatever its batch holds (no deadlock, no unused parameter).

Rank 0 sees only text-only batches while rank 1 sees image-text batches, then they swap; under
DDP(find_unused_parameters=False) the steps must complete, and the parameters must stay identical on
both ranks after every optimizer step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kits.modelkit import make_batch, small_task
from kits.multiproc import run_world
from torch.nn.parallel import DistributedDataParallel

from vltrain.compose.task import Score

STEPS = 4


def _batch_for(rank: int, step: int):
    text_only = (rank == 0) == (step < STEPS // 2)
    n = 4
    has_image = torch.zeros(n, dtype=torch.bool) if text_only else torch.ones(n, dtype=torch.bool)
    return make_batch(n, seed=100 * step + rank, has_image=has_image, ids=torch.arange(n) + 10 * rank)


MODELS = {"dual-encoder": ("tiny-clip", dict(itc=1.0, siglip=1.0)), "fusion": ("tiny-albef", dict(itm=1.0, mlm=1.0))}


def _ddp_worker(rank, world):
    results = {}
    for name, (preset, loss) in MODELS.items():
        model = small_task(preset, seed=rank, **loss)  # different init: DDP's broadcast must align them
        ddp = DistributedDataParallel(model, find_unused_parameters=False)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        checks = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            out = ddp(Score(_batch_for(rank, step)))
            out.loss.backward()
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"{name} step {step}: parameters without a gradient: {missing}"
            opt.step()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            checks.append(all(torch.equal(gathered[0], g) for g in gathered))
        results[name] = checks
    return results


@pytest.fixture(scope="module")
def ddp_results():
    """One 2-process run for both models; a hang or a mismatched collective fails within 60 s."""
    return run_world(_ddp_worker, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_name", MODELS)
def test_ddp_with_modalities_differing_by_rank(model_name, ddp_results):
    for per_rank in ddp_results:
        assert per_rank[model_name] == [True] * STEPS
