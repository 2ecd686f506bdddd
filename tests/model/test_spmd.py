"""Every rank runs the same graph whatever its batch holds (no deadlock, no unused parameter).

Rank 0 sees only text-only batches while rank 1 sees image-text batches, then they swap; under
DDP(find_unused_parameters=False) the steps must complete, and the parameters must stay identical on
both ranks after every optimizer step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from modelkit import make_batch, small_model
from multiproc import run_world

STEPS = 4


def _batch_for(rank: int, step: int) -> dict:
    text_only = (rank == 0) == (step < STEPS // 2)
    n = 4
    has_image = torch.zeros(n, dtype=torch.bool) if text_only else torch.ones(n, dtype=torch.bool)
    return make_batch(n, seed=100 * step + rank, has_image=has_image, ids=torch.arange(n) + 10 * rank)


def _ddp_worker(rank, world, preset, loss):
    model = small_model(preset, seed=rank, **loss)  # different init: DDP's broadcast must align them
    ddp = DistributedDataParallel(model, find_unused_parameters=False)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    checks = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = ddp(**_batch_for(rank, step))
        out.loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"step {step}: parameters without a gradient: {missing}"
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        checks.append(all(torch.equal(gathered[0], g) for g in gathered))
    return checks


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "preset,loss",
    [("tiny-clip", dict(itc=1.0, siglip=1.0)), ("tiny-albef", dict(itm=1.0, mlm=1.0))],
    ids=["dual-encoder", "fusion"],
)
def test_ddp_with_modalities_differing_by_rank(preset, loss):
    results = run_world(_ddp_worker, (preset, loss), timeout=60)
    for rank_checks in results:
        assert rank_checks == [True] * STEPS
